//! A reactor for the owners' unit tests: it hands out tokens and timer ids and records who
//! they belong to, as the engine's `Routing` does, but nothing ever fires. Sources register
//! with a real `mio::Poll` that no one polls.

use std::collections::HashMap;
use std::time::Duration;

use mio::Token;

use super::{Owner, Reach, TimerOwner};

use crate::reactor::TimerId;

pub(super) struct FakeReach {
    poll: mio::Poll,
    next: usize,
    pub(super) owners: HashMap<Token, Owner<()>>,
    /// Armed timers, with the delay each was armed for.
    pub(super) timers: HashMap<TimerId, (Duration, TimerOwner<()>)>,
    pub(super) cancelled: Vec<TimerId>,
}

impl FakeReach {
    pub(super) fn new() -> FakeReach {
        FakeReach {
            poll: mio::Poll::new().expect("poll"),
            next: 0,
            owners: HashMap::new(),
            timers: HashMap::new(),
            cancelled: Vec::new(),
        }
    }
}

impl Reach for FakeReach {
    type Key = ();

    fn registry(&self) -> &mio::Registry {
        self.poll.registry()
    }

    fn token(&mut self, owner: Owner<()>) -> Token {
        self.next += 1;
        self.owners.insert(Token(self.next), owner);
        Token(self.next)
    }

    fn forget(&mut self, token: Token) {
        self.owners.remove(&token);
    }

    fn timer(&mut self, after: Duration, owner: TimerOwner<()>) -> TimerId {
        self.next += 1;
        let id = TimerId::fake(self.next as u64);
        self.timers.insert(id, (after, owner));
        id
    }

    fn cancel(&mut self, id: TimerId) {
        self.timers.remove(&id);
        self.cancelled.push(id);
    }
}
