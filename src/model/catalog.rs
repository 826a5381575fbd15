//! What caliban knows about models by name: context windows and list prices. Both are
//! lookups by prefix over small tables; a model not listed has no known window (no automatic
//! compaction unless settings give one) and no known price (cost reported as unknown, never
//! guessed).

use crate::model::types::Usage;

/// Context windows in tokens, by model-name prefix; the first match wins, so longer
/// prefixes of a family come before shorter ones.
const WINDOWS: &[(&str, u64)] = &[
    ("claude-", 200_000),
    ("gpt-4.1", 1_047_576),
    ("gpt-4o", 128_000),
    ("gpt-5", 400_000),
    ("o3", 200_000),
    ("o4-mini", 200_000),
];

/// Published list prices (USD per million tokens, input/output).
const PRICES: &[(&str, f64, f64)] = &[
    ("claude-opus-4", 15.0, 75.0),
    ("claude-sonnet-4", 3.0, 15.0),
    ("claude-haiku-4", 1.0, 5.0),
    ("claude-3-5-haiku", 0.8, 4.0),
    ("gpt-4.1-mini", 0.4, 1.6),
    ("gpt-4.1", 2.0, 8.0),
    ("gpt-4o-mini", 0.15, 0.6),
    ("gpt-4o", 2.5, 10.0),
];

/// The model's context window in tokens, if it is a model we know.
pub fn context_window(model: &str) -> Option<u64> {
    WINDOWS
        .iter()
        .find(|(prefix, _)| model.starts_with(prefix))
        .map(|(_, window)| *window)
}

/// What `usage` cost at list prices, rounded to a millionth of a dollar; `None` for a model
/// whose price we do not know.
pub fn cost_usd(model: &str, usage: &Usage) -> Option<f64> {
    let (_, input, output) = PRICES
        .iter()
        .find(|(prefix, _, _)| model.starts_with(prefix))?;
    let cost = usage.input_tokens as f64 * input / 1e6 + usage.output_tokens as f64 * output / 1e6;
    Some((cost * 1e6).round() / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_and_unknown_models() {
        assert_eq!(context_window("claude-sonnet-4-5"), Some(200_000));
        assert_eq!(context_window("gpt-4o-mini"), Some(128_000));
        assert_eq!(context_window("qwen2.5-coder"), None);
        let usage = Usage {
            input_tokens: 1_000_000,
            output_tokens: 1_000_000,
            ..Usage::default()
        };
        assert_eq!(cost_usd("gpt-4.1-mini-2025", &usage), Some(2.0));
        assert_eq!(cost_usd("llama", &usage), None);
    }
}
