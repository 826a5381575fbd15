//! Test-only helpers shared by the codec tests: every way to split a message, and
//! deterministic noise for the no-panic checks.

/// Every way to deliver `msg`: whole, in two pieces at each offset, one byte at a time.
pub fn deliveries(msg: &[u8]) -> Vec<Vec<&[u8]>> {
    let mut all = vec![vec![msg]];
    for at in 0..=msg.len() {
        let (a, b) = msg.split_at(at);
        all.push(vec![a, b]);
    }
    if !msg.is_empty() {
        all.push(msg.chunks(1).collect());
    }
    all
}

/// Deterministic noise drawn mostly from bytes that mean something to the parser, to
/// shake out panics (overflow, slicing) that hand-written cases miss.
pub fn noise(seed: u64, alphabet: &[u8], len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let pick = (state >> 32) as usize;
            if pick.is_multiple_of(8) {
                (state >> 8) as u8
            } else {
                alphabet[pick % alphabet.len()]
            }
        })
        .collect()
}
