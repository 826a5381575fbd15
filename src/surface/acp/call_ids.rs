//! Tool-call ids on the ACP wire. ACP asks for a `toolCallId` unique in the session, and
//! the model's ids are not: local servers repeat them (`call_0` every turn, or the same id
//! for parallel calls), which made live cards share one id and `session/load` replay one
//! call's result as another's. The model's id stays what the model and the drive core use;
//! this maps it to a session-unique id for the editor: the model's own id the first time the
//! session shows it (so a well-behaved model's ids reach the editor unchanged), else the
//! first free `<id>#2`, `<id>#3`, ….
//!
//! Which open card a model id names follows the run's rules (`agent::run`): a repeat of an
//! id within a turn is refused, so the first card opened with an id is the call that runs,
//! asks or is placed; the refused repeats' ends come before that call's own end; input
//! fragments belong to the card that was opened last.

use std::collections::{HashMap, HashSet};

#[derive(Debug, Default)]
pub(super) struct CallIds {
    /// Every id the session has put on the wire, live or in a replay.
    used: HashSet<String>,
    /// Open cards by the model's id, oldest first (their wire ids).
    open: HashMap<String, Vec<String>>,
}

impl CallIds {
    /// A wire id for a new call with the model's `id`, not used before in the session.
    fn fresh(&mut self, id: &str) -> String {
        let mut wire = id.to_owned();
        let mut n = 1u64;
        while self.used.contains(&wire) {
            n += 1;
            wire = format!("{id}#{n}");
        }
        self.used.insert(wire.clone());
        wire
    }

    /// A card opens for a call with the model's `id`; its wire id.
    pub(super) fn open(&mut self, id: &str) -> String {
        let wire = self.fresh(id);
        self.open
            .entry(id.to_owned())
            .or_default()
            .push(wire.clone());
        wire
    }

    /// The card of the call the model's `id` names for running, asking or placing it: the
    /// first one opened.
    pub(super) fn current(&self, id: &str) -> Option<&str> {
        self.open.get(id)?.first().map(String::as_str)
    }

    /// The card an input fragment for `id` belongs to: the last one opened.
    pub(super) fn streaming(&self, id: &str) -> Option<&str> {
        self.open.get(id)?.last().map(String::as_str)
    }

    /// A call with the model's `id` ended: the card it closes. While repeats of the id are
    /// open, the end is a repeat's (the oldest open one); the first card closes last.
    pub(super) fn close(&mut self, id: &str) -> Option<String> {
        let cards = self.open.get_mut(id)?;
        let wire = if cards.len() > 1 {
            cards.remove(1)
        } else {
            cards.remove(0)
        };
        if cards.is_empty() {
            self.open.remove(id);
        }
        Some(wire)
    }

    /// Every card still open (the run ended), in no particular order.
    pub(super) fn close_all(&mut self) -> Vec<String> {
        self.open.drain().flat_map(|(_, cards)| cards).collect()
    }

    /// The wire ids of a replay (made with a fresh `CallIds`), so no later card reuses one.
    pub(super) fn absorb(&mut self, replayed: CallIds) {
        self.used.extend(replayed.used);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_id_is_kept_and_a_repeat_is_renamed() {
        let mut ids = CallIds::default();
        assert_eq!(ids.open("toolu_1"), "toolu_1");
        assert_eq!(ids.close("toolu_1").as_deref(), Some("toolu_1"));
        // The next turn repeats it (a local server's `call_0` every turn).
        assert_eq!(ids.open("toolu_1"), "toolu_1#2");
        assert_eq!(ids.close("toolu_1").as_deref(), Some("toolu_1#2"));
        assert_eq!(ids.open("toolu_1"), "toolu_1#3");
        // A model id that looks like a renamed one is renamed in turn.
        assert_eq!(ids.open("toolu_1#2"), "toolu_1#2#2");
    }

    #[test]
    fn repeats_in_one_turn_close_before_the_call_that_counts() {
        let mut ids = CallIds::default();
        let (first, second, third) = (ids.open("c"), ids.open("c"), ids.open("c"));
        assert_eq!(
            (first.as_str(), second.as_str(), third.as_str()),
            ("c", "c#2", "c#3")
        );
        assert_eq!(ids.streaming("c"), Some("c#3"));
        assert_eq!(ids.current("c"), Some("c"));
        assert_eq!(ids.close("c").as_deref(), Some("c#2"));
        assert_eq!(ids.close("c").as_deref(), Some("c#3"));
        assert_eq!(ids.current("c"), Some("c"));
        assert_eq!(ids.close("c").as_deref(), Some("c"));
        assert_eq!(ids.close("c"), None);
        assert_eq!(ids.current("c"), None);
    }

    #[test]
    fn replayed_ids_are_not_reused() {
        let mut replay = CallIds::default();
        replay.open("a");
        replay.open("a");
        let mut ids = CallIds::default();
        ids.absorb(replay);
        assert_eq!(ids.open("a"), "a#3");
        ids.open("b");
        let mut open = ids.close_all();
        open.sort();
        assert_eq!(open, ["a#3", "b"]);
        assert_eq!(ids.current("a"), None);
    }
}
