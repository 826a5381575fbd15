//! Durable sessions: one append-only JSONL file per run, and the run's event log that cursor
//! reads are served from, with bounded memory.
//!
//! FILE FORMAT. `<dir>/run-<N>.jsonl`, one JSON object per `\n`-terminated line:
//!
//! ```text
//! {"kind":"header","v":1,"run_id":"run-3","created_ms":…,"prompt":"…",…caller fields}
//! {"kind":"event","cursor":N,"event":<TurnEvent JSON>}     cursor = 0-based event index
//! {"kind":"status","cursor":K,"status":{"state":"running"}}      K = events written before it
//! {"kind":"permission","cursor":K,"request":{"tool_use_id","tool_name","input"}|null}
//! {"kind":"input","cursor":K,"input":{"type":"user_message","text":"…"}|{"type":"end_input"}}
//! ```
//!
//! Event cursors are dense: an event that cannot be stored as itself (its line would exceed
//! `MAX_LINE_BYTES`, or it nests deeper than `MAX_EVENT_DEPTH`) is replaced, on disk and in
//! memory alike, by a marker event `{"type":"Oversized","bytes":…}` (or
//! `{"type":"Oversized","max_depth":…}`), so every cursor names exactly one event.
//!
//! CRASH SAFETY. Each line goes out in one `write` on a descriptor opened with `O_APPEND`, so a
//! crash at any byte leaves whole lines plus at most one partial last line. Readers accept only
//! `\n`-terminated lines, skip kinds they do not know (forward compatibility), and stop at the
//! first line that does not parse: everything before it is the readable prefix, everything from
//! it on is reported by `EventLog::ignored_bytes`. A failed append is cut back off the file, so
//! a full disk never strands a partial line in the middle.
//!
//! STAGING. A drive surface's events arrive a few at a time per model read, and many runs'
//! reads are handled in one round of the loop. `EventLog::stage_event` gives an event its
//! cursor and holds its line in memory; `EventLog::flush` writes every line held with one
//! `write`, and only then does the log show the events (`len`, `read`): a reader never sees
//! an event the file does not have. The drive core flushes each run that changed at the end
//! of every round of wakes, before any surface looks at the log (`DriveCore::after_batch`);
//! any other line (status, permission, input) and letting go of the file (`idle`, `close`)
//! flush first, so lines keep their order and a terminal status follows every event. A log
//! holds at most `STAGE_BYTES` or `STAGE_EVENTS` before it flushes on its own. What a crash
//! can lose grows by the events of the round in progress: never shown to anyone, and the
//! model exchange that produced them is lost with the process anyway.
//!
//! DURABILITY. Lines are written, not synced, as they go: a process crash loses nothing the
//! kernel has, a power cut may lose the end of a run still in progress. When a run finishes
//! (`SessionStore::close`) its file's data, and the first time also the directory entry that
//! names it, is flushed to stable storage on the store's syncer thread, so the event loop
//! never waits on the disk. The file is readable at once (reads go through the page cache);
//! only durability lags, by one `fsync`. Dropping the store (every orderly exit: a signal or
//! stdin closing ends the loop, and the surface drops its drive core) waits up to
//! `SYNC_EXIT_WAIT` for syncs still pending, so a run that finished before an orderly exit
//! survives a power cut after it. When the syncer cannot take a sync (its queue is full, or no
//! thread starts) the sync is done in place, on the caller's thread, as before.
//!
//! MEMORY. A log keeps the newest events in a tail of at most `TAIL_EVENTS` events and
//! `TAIL_BYTES` bytes, and a sparse index with the byte offset of every `INDEX_STRIDE`-th event
//! line. Older events are read back from the file, so a run costs O(tail + events / 64 × 8 B)
//! however long it is and however slow its readers are. A loaded (past) run keeps no tail.
//!
//! Reads of the file are blocking `pread`s on the caller's thread. They are small: a read starts
//! at most `INDEX_STRIDE` events before its cursor and stops once `max_bytes` are gathered.
//!
//! LOCKING. The process that writes a run holds an exclusive `flock` on its file, so a second
//! server sharing the directory never appends to a run that is still being written. A loaded
//! run becomes appendable on its first append (say, to mark it interrupted): that takes the
//! lock, reads lines written since the load, and cuts off a crash's partial last line. A file
//! damaged in the middle is never appended to, since the new lines would be unreadable too.
//! Closing a finished run releases the lock at once, before its sync is done.
//!
//! An idle run (one waiting for input, which a server may hold by the ten thousand) keeps no
//! descriptor either (`SessionStore::idle`). Its lock is then the process's own: each store
//! holds an exclusive `flock` on `<dir>/.writers/<writer>.lock` for as long as it lives and
//! names `<writer>` in the header of every run it creates, so another process that finds a
//! run's file unlocked still leaves it alone while that writer lock is held. A writer that
//! crashed leaves its lock file unlocked, and the next store to create a run there removes it.

use crate::clock::now_ms;
use crate::log;
use crate::workers::Pool;
use std::borrow::Cow;
use std::collections::VecDeque;
use std::fmt;
use std::fs::{self, DirBuilder, File, OpenOptions, TryLockError};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::mem;
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Map, Value, json};

/// The `v` of the header line. A file with another version is refused rather than misread.
pub const FORMAT_VERSION: u64 = 1;

/// The longest line, newline included, that is written or read. It bounds what one line can
/// make a reader buffer, so a corrupt file cannot make `load` allocate without limit.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// The most events the in-memory tail of a live log holds.
pub const TAIL_EVENTS: usize = 256;

/// The most event bytes the in-memory tail of a live log holds; an event larger than this is
/// only ever served from the file.
pub const TAIL_BYTES: usize = 1 << 20;

/// One sparse-index entry (a byte offset) per this many events. A file read starts at most
/// this many events before the cursor asked for.
pub const INDEX_STRIDE: u64 = 64;
/// Status transitions remembered per run for `status_at`.
pub const MAX_STATUS_CHANGES: usize = 1024;

/// The deepest event nesting stored as is. serde_json refuses to parse past 127 levels and
/// the line wrapper is one of them, so a deeper event could be written but never read back.
pub const MAX_EVENT_DEPTH: usize = 126;

/// A log flushes its staged event lines itself once they reach this many bytes or events,
/// whatever the round: it bounds what one run holds in memory between writes. A round rarely
/// comes near it (a model read of a few KiB is a few dozen events).
pub const STAGE_BYTES: usize = 64 << 10;
pub const STAGE_EVENTS: usize = 64;

/// Buffer for reading session files.
const READ_BUF_BYTES: usize = 64 << 10;

/// The start of an event line as `EventLog::append_event` writes it.
const EVENT_LINE_PREFIX: &str = r#"{"kind":"event","cursor":"#;

/// How long dropping a store (an orderly exit) waits for pending syncs. A sync normally takes
/// milliseconds; this only bounds a stuck disk, and stays under the 10 s a container runtime
/// gives between SIGTERM and SIGKILL.
pub const SYNC_EXIT_WAIT: Duration = Duration::from_secs(5);

/// Where the stores writing a directory hold their writer locks, under the directory.
const WRITERS_DIR: &str = ".writers";

/// Syncer threads. Syncs of one directory's files share a disk and a journal, so a second
/// thread would mostly wait on the first; one also keeps syncs in the order runs finished.
const SYNC_WORKERS: usize = 1;

/// Finished runs waiting for their sync, each holding its file's descriptor until then: at
/// least this many, and as many as the drive table lets work at once
/// (`SessionStore::expect_working_runs`), so a burst of every working run finishing at once
/// fits (the descriptors are the ones those runs held while working). Past it a close syncs
/// in place, slower but losing nothing: on the loop, where 1,000 runs ending together once
/// cost 90 `fdatasync`s (a relay benchmark), each a stall in which nobody was answered.
const SYNC_QUEUE_CAP: usize = 256;

/// Where session files live: `$XDG_STATE_HOME/caliban/sessions`, or
/// `$HOME/.local/state/caliban/sessions`. The XDG spec says to ignore a relative or empty
/// `XDG_STATE_HOME`. `env` looks up environment variables so tests need not touch the process's.
pub fn default_dir(env: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf, String> {
    if let Some(state) = env("XDG_STATE_HOME").filter(|dir| dir.starts_with('/')) {
        return Ok(Path::new(&state).join("caliban/sessions"));
    }
    match env("HOME").filter(|home| !home.is_empty()) {
        Some(home) => Ok(Path::new(&home).join(".local/state/caliban/sessions")),
        None => Err("cannot place session files: neither XDG_STATE_HOME nor HOME is set".into()),
    }
}

/// The number in a run id of the form `run-<N>` (decimal, no sign, no leading zero), or `None`.
/// Only such ids name files, so an id from a client can never reach outside the directory, and
/// each number has exactly one id.
pub fn run_number(run_id: &str) -> Option<u64> {
    crate::ids::RunId::parse(run_id).map(|id| id.0)
}

/// A past run as `SessionStore::list` reports it (tests only: the drive table pages run
/// numbers with `run_numbers_below` and loads just the runs it shows).
#[cfg(test)]
#[derive(Clone, Debug, PartialEq)]
pub struct SessionSummary {
    pub run_id: String,
    /// The header line's object, or `Null` when the file has no whole header line (a crash
    /// during `create`).
    pub header: Value,
    pub events: u64,
    pub status: Option<Value>,
    /// The permission request that was pending when the file ends.
    pub permission: Option<Value>,
    /// The file's modification time, in milliseconds since the Unix epoch.
    pub modified_ms: u64,
}

/// The sessions directory: allocates run ids, opens run files and syncs finished ones.
#[derive(Debug)]
pub struct SessionStore {
    dir: PathBuf,
    /// The number `create` tries first.
    next_run: u64,
    /// This store's writer id and its locked lock file, named in the header of every run it
    /// creates; `None` before the first run (a stdio server that never starts one makes no
    /// lock file) and where the file system has no `flock` (idle runs then keep their
    /// descriptor, and with it their own lock).
    writer: Option<(Arc<str>, File)>,
    writer_tried: bool,
    syncer: Syncer,
    /// Whether `close` syncs a finished run's file (`without_syncs`).
    sync_on_close: bool,
}

/// Where `SessionStore::close` sends syncs; dropping it waits for them (with a deadline).
#[derive(Debug)]
struct Syncer(Pool);

impl Drop for Syncer {
    fn drop(&mut self) {
        if !self.0.wait_idle(Instant::now() + SYNC_EXIT_WAIT) {
            log::warn(&format!(
                "session files of finished runs were still not on disk after {} s; exiting anyway",
                SYNC_EXIT_WAIT.as_secs()
            ));
        }
    }
}

impl SessionStore {
    /// Opens `dir`, creating it (mode 0700: sessions hold prompts and tool output) if needed.
    pub fn open(dir: PathBuf) -> io::Result<SessionStore> {
        DirBuilder::new().recursive(true).mode(0o700).create(&dir)?;
        let next_run = max_run_number(&dir)?.map_or(1, |n| n.saturating_add(1));
        Ok(SessionStore {
            dir,
            next_run,
            writer: None,
            writer_tried: false,
            syncer: Syncer(Pool::new("caliban-sync", SYNC_WORKERS, SYNC_QUEUE_CAP).background()),
            sync_on_close: true,
        })
    }

    /// A store whose finished runs are closed without a sync: print mode's, whose one run
    /// ends as the process does. Every line is already written, so a crash of the process
    /// loses nothing; only a power cut right after the run can lose its end. Waiting for the
    /// disk at exit cost about 20 ms a run, more than the rest of a short print run.
    pub fn without_syncs(mut self) -> SessionStore {
        self.sync_on_close = false;
        self
    }

    /// Makes room in the syncer's queue for `runs` finishing at once (see `SYNC_QUEUE_CAP`).
    /// Call before the first run finishes: syncs already queued would be waited for here.
    pub fn expect_working_runs(&mut self, runs: usize) {
        let cap = runs.max(SYNC_QUEUE_CAP);
        if cap != self.syncer.0.queue_cap() {
            self.syncer = Syncer(Pool::new("caliban-sync", SYNC_WORKERS, cap).background());
        }
    }

    #[cfg(test)]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `run_id`, which must already be validated.
    fn path_of(&self, run_id: &str) -> PathBuf {
        self.dir.join(format!("{run_id}.jsonl"))
    }

    /// Starts a new run file with the next free run number and writes its header: `header`'s
    /// fields after `kind`, `v` and `run_id` (which are set here), plus `created_ms` unless the
    /// caller set it.
    pub fn create(&mut self, mut header: Map<String, Value>) -> io::Result<EventLog> {
        for reserved in ["kind", "v", "run_id"] {
            header.remove(reserved);
        }
        header
            .entry("created_ms")
            .or_insert_with(|| json!(now_ms()));
        if !self.writer_tried {
            self.writer_tried = true;
            self.writer = take_writer_lock(&self.dir).unwrap_or_else(|e| {
                log::debug(&format!("no writer lock in {}: {e}", self.dir.display()));
                None
            });
        }
        match &self.writer {
            Some((writer, _)) => header.insert("writer".into(), json!(writer.as_ref())),
            None => header.remove("writer"),
        };
        if header
            .values()
            .any(|v| nested_deeper_than(v, MAX_EVENT_DEPTH))
        {
            return Err(invalid_input(
                "session header nests too deeply to be read back",
            ));
        }
        // The fields go out in map order after the three fixed ones, so `head -1` shows what
        // the line is first.
        let mut fields = String::new();
        for (key, value) in &header {
            fields.push(',');
            fields.push_str(&serde_json::to_string(key)?);
            fields.push(':');
            fields.push_str(&serde_json::to_string(value)?);
        }
        let longest_id = "run-18446744073709551615";
        if header_line(longest_id, &fields).len() > MAX_LINE_BYTES {
            return Err(invalid_input(
                "session header is longer than the session line cap",
            ));
        }
        loop {
            let number = self.next_run;
            let run_id = format!("run-{number}");
            let path = self.path_of(&run_id);
            // `create_new` is the arbiter between servers sharing the directory: whoever
            // creates the file owns the number.
            let opened = OpenOptions::new()
                .read(true)
                .append(true)
                .create_new(true)
                .mode(0o600)
                .open(&path);
            let file = match opened {
                Ok(file) => file,
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {
                    let taken = max_run_number(&self.dir)?.unwrap_or(number).max(number);
                    self.next_run = taken
                        .checked_add(1)
                        .ok_or_else(|| io::Error::other("no free run number is left"))?;
                    continue;
                }
                Err(error) => return Err(error),
            };
            self.next_run = number.saturating_add(1);
            // Remember the highest number ever used, so a deleted newest run's id is never
            // handed out again (a stale client could otherwise read a different run).
            let _ = fs::write(self.dir.join(HIGH_WATER_FILE), number.to_string());
            let line = header_line(&run_id, &fields);
            let started =
                lock_for_append(&file, &run_id).and_then(|()| (&file).write_all(line.as_bytes()));
            if let Err(error) = started {
                let _ = fs::remove_file(&path);
                return Err(error);
            }
            let mut full = Map::new();
            full.insert("kind".into(), json!("header"));
            full.insert("v".into(), json!(FORMAT_VERSION));
            full.insert("run_id".into(), json!(run_id));
            full.append(&mut header);
            let mut log = EventLog::new(run_id, path, Access::Append(file), Tail::live());
            log.own_writer = self.writer.as_ref().map(|(writer, _)| writer.clone());
            log.header = Value::Object(full);
            log.end = line.len() as u64;
            return Ok(log);
        }
    }

    /// A log for a run whose file `create` could not make, for a run that may go on
    /// unrecorded (print mode's): it takes the next run id, holds the header in memory only
    /// and refuses every append, so the run is driven as any other. It names no path: nothing
    /// it does can touch a file, another process's run of that number included.
    pub fn unrecorded(&mut self, mut header: Map<String, Value>) -> EventLog {
        let run_id = format!("run-{}", self.next_run);
        self.next_run = self.next_run.saturating_add(1);
        let mut full = Map::new();
        full.insert("kind".into(), json!("header"));
        full.insert("v".into(), json!(FORMAT_VERSION));
        full.insert("run_id".into(), json!(run_id));
        for reserved in ["kind", "v", "run_id"] {
            header.remove(reserved);
        }
        full.append(&mut header);
        let mut log = EventLog::new(run_id, PathBuf::new(), Access::Detached, Tail::live());
        log.header = Value::Object(full);
        log.stop_appending();
        log
    }

    /// Every run file in the directory, sorted by run number. A file that cannot be read (or has
    /// a format version this build does not know) is left out rather than failing the list.
    #[cfg(test)]
    pub fn list(&self) -> io::Result<Vec<SessionSummary>> {
        let logs = self.list_logs()?;
        Ok(logs.into_iter().map(|(summary, _)| summary).collect())
    }

    /// `list`, with each run's loaded log too, for a caller that wants both without scanning
    /// every file twice.
    #[cfg(test)]
    pub fn list_logs(&self) -> io::Result<Vec<(SessionSummary, EventLog)>> {
        let mut sessions = Vec::new();
        for entry in fs::read_dir(&self.dir)? {
            let Ok(entry) = entry else {
                continue;
            };
            let file_name = entry.file_name();
            let Some(run_id) = file_name.to_str().and_then(|n| n.strip_suffix(".jsonl")) else {
                continue;
            };
            let Some(number) = run_number(run_id) else {
                continue;
            };
            let Ok(log) = self.load(run_id) else {
                continue;
            };
            let modified_ms = entry
                .metadata()
                .and_then(|meta| meta.modified())
                .map(crate::clock::millis_since_epoch)
                .unwrap_or(0);
            let summary = SessionSummary {
                run_id: log.run_id.clone(),
                header: log.header.clone(),
                events: log.events,
                status: log.status.clone(),
                permission: log.permission.clone(),
                modified_ms,
            };
            sessions.push((number, summary, log));
        }
        sessions.sort_by_key(|(number, ..)| *number);
        Ok(sessions
            .into_iter()
            .map(|(_, summary, log)| (summary, log))
            .collect())
    }

    /// The numbers of the newest `limit` runs numbered below `below` (every number when
    /// `None`), oldest first, and whether older ones remain. One pass over the directory's
    /// names, holding no more than `limit` numbers, so a page of a huge directory stays small.
    pub fn run_numbers_below(
        &self,
        below: Option<u64>,
        limit: usize,
    ) -> io::Result<(Vec<u64>, bool)> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        // The `limit` largest so far, smallest on top.
        let mut kept: BinaryHeap<Reverse<u64>> = BinaryHeap::with_capacity(limit + 1);
        let mut more = false;
        for entry in fs::read_dir(&self.dir)? {
            let Ok(entry) = entry else {
                continue;
            };
            let file_name = entry.file_name();
            let Some(number) = file_name
                .to_str()
                .and_then(|name| name.strip_suffix(".jsonl"))
                .and_then(run_number)
            else {
                continue;
            };
            if below.is_some_and(|below| number >= below) {
                continue;
            }
            kept.push(Reverse(number));
            if kept.len() > limit {
                kept.pop();
                more = true;
            }
        }
        let mut numbers: Vec<u64> = kept.into_iter().map(|Reverse(n)| n).collect();
        numbers.sort_unstable();
        Ok((numbers, more))
    }

    /// Whether another process still writes the run of `log` (a loaded one): it holds the
    /// file's lock, or the run is idle there and its writer lock is held.
    pub fn written_elsewhere(&self, log: &EventLog) -> bool {
        File::open(&log.path)
            .is_ok_and(|file| matches!(file.try_lock(), Err(TryLockError::WouldBlock)))
            || log.writer_alive_elsewhere()
    }

    /// Lets go of a live run's descriptor while it waits for input, so idle runs hold none;
    /// its tail stays, and its next append takes the file again. Only for a run this store
    /// created while it holds its writer lock (which keeps other processes off the file);
    /// otherwise the run keeps its descriptor.
    pub fn idle(&self, log: &mut EventLog) {
        let ours = match (&self.writer, &log.own_writer) {
            (Some((writer, _)), Some(own)) => writer == own,
            _ => false,
        };
        if let Err(e) = log.flush() {
            log::error(&format!("{}: staged events lost: {e}", log.run_id));
        }
        log.release_staging();
        if !ours || !matches!(log.access, Access::Append(_)) {
            return;
        }
        if let Access::Append(file) = mem::replace(&mut log.access, Access::Detached) {
            let _ = file.unlock();
        }
    }

    /// The log of a past (or concurrently written) run: its readable prefix, indexed. It holds
    /// no file descriptor until something is appended to it; `EventLog::refresh` picks up lines
    /// another process appended since.
    pub fn load(&self, run_id: &str) -> io::Result<EventLog> {
        check_run_id(run_id)?;
        let path = self.path_of(run_id);
        let file = File::open(&path)?;
        let mut log = EventLog::new(run_id.to_owned(), path, Access::Detached, Tail::none());
        log.own_writer = self.writer.as_ref().map(|(writer, _)| writer.clone());
        log.ingest(&file)?;
        Ok(log)
    }

    /// `EventLog::close` without waiting on the disk: the descriptor's lock is let go at
    /// once, and the sync runs on the syncer thread, which holds the descriptor until it is
    /// done. The tail stays until the caller calls `EventLog::release_tail`: a run's last
    /// events are what its followers are about to read, and the drive core lets go of it once
    /// they had their round (`DriveCore::end_round`). A failed sync is logged; it costs
    /// durability only, the lines are already written.
    pub fn close(&self, log: &mut EventLog) {
        let Some(pending) = log.detach() else {
            return;
        };
        if !self.sync_on_close {
            // Dropping it closes the descriptor; its lock is already let go.
            return;
        }
        let job = move || pending.run();
        if let Err(rejected) = self.syncer.0.submit(job) {
            crate::log::debug(&format!("syncing in place: {rejected}"));
            (rejected.job)();
        }
    }

    /// `close` without the sync, for a run this process only read or marked interrupted:
    /// losing that last line to a power cut costs nothing (the next start marks the run
    /// again), while a start-up that loads a thousand interrupted runs would otherwise wait
    /// on a thousand `fsync`s once the syncer's queue is full.
    pub fn let_go(&self, log: &mut EventLog) {
        drop(log.detach());
        log.release_tail();
    }

    /// Waits until every sync handed over by `close` is done, or until `deadline`; returns
    /// whether they all are.
    #[cfg(test)]
    pub fn wait_for_syncs(&self, deadline: Instant) -> bool {
        self.syncer.0.wait_idle(deadline)
    }

    /// Removes a run's file. A live `EventLog` of it keeps working on the unlinked file until
    /// dropped, but nothing can load it again.
    /// Removes a run's file, unless another process still writes it (`WouldBlock`).
    pub fn delete(&self, run_id: &str) -> io::Result<()> {
        check_run_id(run_id)?;
        let path = self.path_of(run_id);
        let file = OpenOptions::new().read(true).open(&path)?;
        let idle_elsewhere = || {
            self.load(run_id)
                .is_ok_and(|log| log.writer_alive_elsewhere())
        };
        if matches!(file.try_lock(), Err(TryLockError::WouldBlock)) || idle_elsewhere() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!("{run_id} is being written by another caliban process"),
            ));
        }
        fs::remove_file(path)
    }
}

impl Drop for SessionStore {
    /// The writer lock file goes with its store (a crash leaves it to the next store's sweep).
    fn drop(&mut self) {
        if let Some((writer, _)) = &self.writer {
            let _ = fs::remove_file(self.dir.join(WRITERS_DIR).join(format!("{writer}.lock")));
        }
    }
}

/// How a log reaches its file.
enum Access {
    /// Lines are appended to this descriptor (read + append, `flock`ed) and reads `pread` it.
    Append(File),
    /// An append failed part-way and the partial line could not be cut off again. Reads still
    /// work; appends fail, since a line after a partial one would never be read back.
    Poisoned(File),
    /// No descriptor held (a loaded run): reads reopen the path, and the first append opens,
    /// locks and trims the file, becoming `Append`.
    Detached,
}

/// One run's event log, backed by its session file.
pub struct EventLog {
    run_id: String,
    path: PathBuf,
    /// The header line's object; `Null` until a whole header line has been seen.
    header: Value,
    access: Access,
    /// Events so far, which is also the next event's cursor.
    events: u64,
    /// The offset just past the last whole line accepted; nothing past it is ever read.
    end: u64,
    /// `index[i]` is the offset of the line of event `i * INDEX_STRIDE`.
    index: Vec<u64>,
    tail: Tail,
    status: Option<Value>,
    /// `(events written before it, status)` for each status line, so `status_at` needs no
    /// file scan; a run changes status a few times per turn, and the oldest are dropped
    /// past `MAX_STATUS_CHANGES`.
    status_changes: VecDeque<(u64, Value)>,
    permission: Option<Value>,
    /// A scan stopped at a line that will never parse, so later lines are unreachable and the
    /// file is never appended to (that would bury the new lines behind the damage too).
    damaged: bool,
    /// Bytes past `end` that the last scan could not use.
    ignored: u64,
    /// Whether `sync` has made the file's directory entry durable yet.
    dir_synced: bool,
    /// The writer id of this process's store (the one that created or loaded the log), if
    /// it has one: a header naming it is ours, so its lock does not keep us off the file
    /// (`reopen_for_append`).
    own_writer: Option<Arc<str>>,
    /// Appends are refused from now on (`stop_appending`).
    stopped: bool,
    /// Event lines `stage_event` took and `flush` has not written yet (see STAGING).
    staged: Vec<u8>,
    /// Per staged event: where its line starts in `staged`, and where its JSON sits.
    staged_events: Vec<(usize, std::ops::Range<usize>)>,
}

impl fmt::Debug for EventLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventLog")
            .field("run_id", &self.run_id)
            .field("events", &self.events)
            .field("end", &self.end)
            .field("tail_start", &self.tail.start)
            .field("damaged", &self.damaged)
            .field("staged", &self.staged_events.len())
            .finish_non_exhaustive()
    }
}

impl EventLog {
    fn new(run_id: String, path: PathBuf, access: Access, tail: Tail) -> EventLog {
        EventLog {
            run_id,
            path,
            header: Value::Null,
            access,
            events: 0,
            end: 0,
            index: Vec::new(),
            tail,
            status: None,
            status_changes: VecDeque::new(),
            permission: None,
            damaged: false,
            ignored: 0,
            dir_synced: false,
            own_writer: None,
            stopped: false,
            staged: Vec::new(),
            staged_events: Vec::new(),
        }
    }

    /// Whether the header names a writer other than this process's that is still alive (its
    /// writer lock is held): the run is idle in that process, which will append to it again.
    fn writer_alive_elsewhere(&self) -> bool {
        let Some(writer) = self.header["writer"].as_str() else {
            return false;
        };
        if self.own_writer.as_deref() == Some(writer) || !is_writer_id(writer) {
            return false;
        }
        let Some(dir) = self.path.parent() else {
            return false;
        };
        File::open(dir.join(WRITERS_DIR).join(format!("{writer}.lock")))
            .is_ok_and(|file| matches!(file.try_lock(), Err(TryLockError::WouldBlock)))
    }

    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    #[cfg(test)]
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &Value {
        &self.header
    }

    /// Events so far; the cursor the next event gets.
    pub fn len(&self) -> u64 {
        self.events
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.events == 0
    }

    pub fn last_status(&self) -> Option<&Value> {
        self.status.as_ref()
    }

    /// The pending permission request, or `None` once it was answered.
    #[cfg(test)]
    pub fn last_permission(&self) -> Option<&Value> {
        self.permission.as_ref()
    }

    /// Bytes at the end of the file that the last scan could not read: a partial last line
    /// (a crash, or a line another process is writing right now) or damage and all after it.
    #[cfg(test)]
    pub fn ignored_bytes(&self) -> u64 {
        self.ignored
    }

    /// Appends one event and returns its cursor. An event that cannot be stored as itself is
    /// stored as an `Oversized` marker (see the module docs). On error nothing was appended,
    /// and neither were the events staged before it. (The drive core stages its events and
    /// writes a round's at once; tests write them one by one.)
    #[cfg(test)]
    pub fn append_event(&mut self, event: &Value) -> io::Result<u64> {
        let cursor = self.stage_event(event)?;
        self.flush()?;
        Ok(cursor)
    }

    /// Gives an event its cursor and holds its line for the next `flush` (see STAGING); the
    /// log shows it once it is written. On error the event, and every one staged before it,
    /// is not appended.
    pub fn stage_event(&mut self, event: &Value) -> io::Result<u64> {
        if nested_deeper_than(event, MAX_EVENT_DEPTH) {
            let marker = json!({"type": "Oversized", "max_depth": MAX_EVENT_DEPTH});
            return self.stage_written(|out| Ok(serde_json::to_writer(out, &marker)?));
        }
        self.stage_written(|out| Ok(serde_json::to_writer(out, event)?))
    }

    /// `stage_event` for an event its owner writes itself (`write` appends one JSON value
    /// nesting at most `MAX_EVENT_DEPTH` deep), with no `Value` built on the way.
    pub fn stage_written(
        &mut self,
        write: impl FnOnce(&mut Vec<u8>) -> io::Result<()>,
    ) -> io::Result<u64> {
        if self.stopped || matches!(self.access, Access::Detached) {
            // A stopped log refuses here. Opening a loaded run's file reads what was written
            // since: cursors follow it.
            self.writer()?;
        }
        let cursor = self.events + self.staged_events.len() as u64;
        let start = self.staged.len();
        match write_event_line(&mut self.staged, cursor, write) {
            Ok(body) => self.staged_events.push((start, body)),
            Err(e) => {
                self.staged.truncate(start);
                return Err(e);
            }
        }
        if self.staged.len() >= STAGE_BYTES || self.staged_events.len() >= STAGE_EVENTS {
            self.flush()?;
        }
        Ok(cursor)
    }

    /// Whether events wait in memory for `flush`.
    pub fn has_staged(&self) -> bool {
        !self.staged_events.is_empty()
    }

    /// Writes the staged event lines with one `write`, then shows their events. If the write
    /// fails the staged events are dropped (the file is cut back as for any failed append) and
    /// the log stays as it was.
    pub fn flush(&mut self) -> io::Result<()> {
        self.write_staged(&[])
    }

    /// `flush`, with `record` (a record line, or nothing) written after the staged events in
    /// the same `write`: a run's last events and its terminal status are one write, not two.
    fn write_staged(&mut self, record: &[u8]) -> io::Result<()> {
        if self.staged_events.is_empty() {
            return if record.is_empty() {
                Ok(())
            } else {
                self.write_line(record)
            };
        }
        let mut staged = mem::take(&mut self.staged);
        let events = mem::take(&mut self.staged_events);
        let offset = self.end;
        let lines = staged.len();
        staged.extend_from_slice(record);
        let written = self.write_line(&staged);
        if written.is_ok() {
            // One shared copy of the round's lines serves every event of it from the tail.
            let batch: Arc<str> = Arc::from(crate::text::lossy(&staged[..lines]).as_ref());
            for (start, body) in events {
                if self.events.is_multiple_of(INDEX_STRIDE) {
                    self.index.push(offset + start as u64);
                }
                self.events += 1;
                match EventText::slice(&batch, body) {
                    Some(text) if self.tail.admits(text.len()) => self.tail.push(text),
                    _ => self.tail.skip(),
                }
            }
        }
        // The next round's lines reuse the buffer; `release_staging` frees it.
        self.staged = staged;
        self.staged.clear();
        written
    }

    /// Frees the staging buffer (a run that goes idle or finishes stages nothing for long).
    fn release_staging(&mut self) {
        self.staged = Vec::new();
        self.staged_events = Vec::new();
    }

    /// Records a status change. Like every `append_*`, it updates what the log reports
    /// (`last_status` here) only once the line is written, so the log never claims more than
    /// the file holds.
    pub fn append_status(&mut self, status: &Value) -> io::Result<()> {
        let line = record_line("status", self.record_cursor(), "status", status)?;
        self.write_staged(line.as_bytes())?;
        self.record_status(status.clone());
        Ok(())
    }

    /// Where a record line written now stands: after the staged events, written with it.
    fn record_cursor(&self) -> u64 {
        self.events + self.staged_events.len() as u64
    }

    fn record_status(&mut self, status: Value) {
        if self.status_changes.len() >= MAX_STATUS_CHANGES {
            self.status_changes.pop_front();
        }
        self.status_changes.push_back((self.events, status.clone()));
        self.status = Some(status);
    }

    /// Records the surfaced permission request, or `None` once it is answered.
    pub fn append_permission(&mut self, request: Option<&Value>) -> io::Result<()> {
        let line = record_line(
            "permission",
            self.record_cursor(),
            "request",
            request.unwrap_or(&NULL),
        )?;
        self.write_staged(line.as_bytes())?;
        self.permission = request.filter(|r| !r.is_null()).cloned();
        Ok(())
    }

    /// Records a client input (`{"type":"user_message","text":…}` or `{"type":"end_input"}`),
    /// which `messages` replays.
    pub fn append_input(&mut self, input: &Value) -> io::Result<()> {
        let line = record_line("input", self.record_cursor(), "input", input)?;
        self.write_staged(line.as_bytes())
    }

    /// Events from `cursor` on, as their TurnEvent JSON text paired with their cursor: at most
    /// `max_events`, and no more than `max_bytes` of text except that the first event is always
    /// returned whatever its size (and whatever `max_events` says). Empty when
    /// `cursor >= len()`. Events still in the tail are served from memory, older ones from the
    /// file; both give the same bytes for the same cursor.
    pub fn read(
        &self,
        cursor: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> io::Result<Vec<(u64, EventText)>> {
        let mut batch = Batch {
            events: Vec::new(),
            bytes: 0,
            max_events,
            max_bytes,
        };
        if cursor >= self.events {
            return Ok(batch.events);
        }
        if cursor < self.tail.start {
            self.read_file(cursor, &mut batch)?;
        }
        let mut next = cursor + batch.events.len() as u64;
        while let Some(text) = self.tail.get(next) {
            if !batch.push(next, text) {
                break;
            }
            next += 1;
        }
        Ok(batch.events)
    }

    /// Flushes the file to stable storage, and the first time also the directory entry that
    /// names it, so a finished run survives a power cut. Blocks on the disk; the event loop
    /// closes finished runs through `SessionStore::close` instead.
    #[cfg(test)]
    pub fn sync(&mut self) -> io::Result<()> {
        self.flush()?;
        let (Access::Append(file) | Access::Poisoned(file)) = &self.access else {
            return Ok(());
        };
        let dir = self.path.parent().filter(|_| !self.dir_synced);
        sync_to_disk(file, dir)?;
        self.dir_synced = true;
        Ok(())
    }

    /// Syncs, then lets go of the descriptor (and its lock) and of the in-memory tail, so a
    /// finished run costs only its index. Reads keep working from the file; a later append
    /// reopens it. Blocks on the disk; see `SessionStore::close` for the loop's way.
    #[cfg(test)]
    pub fn close(&mut self) -> io::Result<()> {
        self.sync()?;
        self.access = Access::Detached;
        self.release_tail();
        Ok(())
    }

    /// `close` minus the sync and the tail, the sync returned for the caller to run
    /// (elsewhere). The lock is released now, not when the descriptor finally closes, so this
    /// process (a delete, an append) or another one can take it at once. The directory entry counts as synced
    /// from here on: its sync is in the returned job.
    fn detach(&mut self) -> Option<PendingSync> {
        if let Err(e) = self.flush() {
            log::error(&format!("{}: staged events lost: {e}", self.run_id));
        }
        self.release_staging();
        let access = mem::replace(&mut self.access, Access::Detached);
        let (Access::Append(file) | Access::Poisoned(file)) = access else {
            return None;
        };
        // Without flock support there is no lock to release.
        let _ = file.unlock();
        let dir = self
            .path
            .parent()
            .filter(|_| !self.dir_synced)
            .map(Path::to_path_buf);
        self.dir_synced = true;
        Some(PendingSync {
            file,
            dir,
            run_id: self.run_id.clone(),
        })
    }

    /// Drops the in-memory tail; reads of those events go to the file from now on.
    pub fn release_tail(&mut self) {
        self.tail.clear(self.events);
    }

    /// Reads whole lines another process appended since this log was loaded; returns how many
    /// events arrived. A log this process writes is always current and returns 0.
    #[cfg(test)]
    pub fn refresh(&mut self) -> io::Result<u64> {
        let Access::Detached = self.access else {
            return Ok(0);
        };
        let before = self.events;
        let file = File::open(&self.path)?;
        self.ingest(&file)?;
        Ok(self.events - before)
    }

    /// The conversation, for replaying a run into a new one: the header's `prompt` and every
    /// input `user_message` as user messages, and for every `TurnEnd` event its
    /// `assistant_message` then its `tool_results`, in file order. Empty texts are skipped (the
    /// model APIs reject empty text blocks). An event stored as an `Oversized` marker is lost.
    /// The status the run had when `cursor` events had been written: the last status line
    /// written before event `cursor`. A replay of a finished run opens with it, so its first
    /// line is a status and its terminal status can still be the last line.
    pub fn status_at(&self, cursor: u64) -> Option<&Value> {
        self.status_changes
            .iter()
            .rev()
            .find(|(at, _)| *at <= cursor)
            .or_else(|| self.status_changes.front())
            .map(|(_, status)| status)
    }

    #[cfg(test)]
    pub fn messages(&self) -> io::Result<Vec<Value>> {
        let mut messages = Vec::new();
        self.extend_messages(&mut messages)?;
        Ok(messages)
    }

    /// `messages`, appended to the conversation of the runs this one continues: a
    /// `Compaction` event replaces what it summarised, theirs included
    /// (`agent::compact::replay`).
    pub fn extend_messages(&self, messages: &mut Vec<Value>) -> io::Result<()> {
        self.with_file(|file| {
            let mut lines = LineReader::new(file, 0, self.end);
            while let LineEnd::Whole = lines.next_line()? {
                let Some(line) = parse_line(lines.line()) else {
                    break;
                };
                match line {
                    Line::Header(header) => {
                        // A run that continues an earlier conversation (an ACP session
                        // after a cancel) carries that conversation in its header.
                        if let Some(Value::Array(history)) = header.get("history") {
                            messages.extend(history.iter().cloned());
                        }
                        push_user_text(messages, &header, "prompt");
                    }
                    Line::Input(input) if input["type"] == "user_message" => {
                        push_user_text(messages, &input, "text");
                    }
                    Line::Event { value, .. } if value["type"] == "TurnEnd" => {
                        let mut value = value;
                        let assistant = value["assistant_message"].take();
                        if assistant.is_object() {
                            messages.push(assistant);
                        }
                        if let Value::Array(results) = value["tool_results"].take() {
                            messages.extend(results);
                        }
                    }
                    Line::Event { value, .. } if value["type"] == "Compaction" => {
                        crate::agent::compact::replay(messages, &value);
                    }
                    _ => {}
                }
            }
            Ok(())
        })
    }

    /// Appends one whole line with one write. If the write fails part-way the file is cut back
    /// to the last whole line; if even that fails the log stops appending.
    fn write_line(&mut self, line: &[u8]) -> io::Result<()> {
        let end = self.end;
        let file = self.writer()?;
        let Err(error) = file.write_all(line) else {
            self.end += line.len() as u64;
            return Ok(());
        };
        let cut = file.set_len(end).is_ok();
        if !cut && let Access::Append(file) = mem::replace(&mut self.access, Access::Detached) {
            self.access = Access::Poisoned(file);
        }
        Err(error)
    }

    /// Refuses every later append, while reads go on: for a run that carries on unrecorded
    /// once its file could not be written, rather than leave a file with a hole in it.
    pub fn stop_appending(&mut self) {
        self.stopped = true;
        self.release_staging();
    }

    /// The descriptor to append to, opening a loaded run's file the first time.
    fn writer(&mut self) -> io::Result<&mut File> {
        if self.stopped {
            return Err(io::Error::other(format!(
                "{}: recording stopped after a failed write",
                self.run_id
            )));
        }
        if let Access::Detached = self.access {
            self.reopen_for_append()?;
        }
        match &mut self.access {
            Access::Append(file) => Ok(file),
            Access::Poisoned(_) => Err(io::Error::other(format!(
                "{}: an earlier append failed part-way; not appending after it",
                self.run_id
            ))),
            Access::Detached => Err(io::Error::other("session file is not open")),
        }
    }

    /// Makes a loaded run appendable: locks the file so no other writer is active, catches up
    /// on lines written since the scan, and trims a partial last line left by a crash so the
    /// next line starts on a line boundary. Refuses a damaged file or one with no header.
    fn reopen_for_append(&mut self) -> io::Result<()> {
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&self.path)?;
        lock_for_append(&file, &self.run_id)?;
        self.ingest(&file)?;
        if self.writer_alive_elsewhere() {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "{}: session file is being written by another process",
                    self.run_id
                ),
            ));
        }
        if self.damaged {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: session file is damaged after byte {}; not appending to it",
                    self.run_id, self.end
                ),
            ));
        }
        if self.header.is_null() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: session file has no header line", self.run_id),
            ));
        }
        file.set_len(self.end)?;
        self.ignored = 0;
        self.access = Access::Append(file);
        Ok(())
    }

    /// Runs `f` on a descriptor for reading: the one held, or a fresh read-only one.
    fn with_file<T>(&self, f: impl FnOnce(&File) -> io::Result<T>) -> io::Result<T> {
        match &self.access {
            Access::Append(file) | Access::Poisoned(file) => f(file),
            Access::Detached => f(&File::open(&self.path)?),
        }
    }

    /// Fills `batch` from the file with events from `cursor` up to the tail's start.
    fn read_file(&self, cursor: u64, batch: &mut Batch) -> io::Result<()> {
        let stride = cursor / INDEX_STRIDE;
        let offset = usize::try_from(stride)
            .ok()
            .and_then(|i| self.index.get(i))
            .copied()
            .ok_or_else(|| self.changed_underneath())?;
        self.with_file(|file| {
            let mut lines = LineReader::new(file, offset, self.end);
            let mut expected = stride * INDEX_STRIDE;
            while expected < self.tail.start {
                let LineEnd::Whole = lines.next_line()? else {
                    return Err(self.changed_underneath());
                };
                // Lines before the cursor are stepped over without parsing when their head
                // already says which event they are.
                if let Some((seen, _)) = canonical_event_head(lines.line())
                    && seen < cursor
                {
                    if seen != expected {
                        return Err(self.changed_underneath());
                    }
                    expected += 1;
                    continue;
                }
                let Some(line) = parse_line(lines.line()) else {
                    return Err(self.changed_underneath());
                };
                let Line::Event {
                    cursor: seen, text, ..
                } = line
                else {
                    continue;
                };
                if seen != expected {
                    return Err(self.changed_underneath());
                }
                expected += 1;
                if seen >= cursor && !batch.push(seen, &EventText::new(&text)) {
                    break;
                }
            }
            Ok(())
        })
    }

    fn changed_underneath(&self) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("{}: session file changed underneath its log", self.run_id),
        )
    }

    /// Reads whole lines from `self.end` on, updating the log, until the end of the file, a
    /// partial last line or a line that does not parse.
    fn ingest(&mut self, file: &File) -> io::Result<()> {
        if !self.damaged {
            let mut lines = LineReader::new(file, self.end, u64::MAX);
            loop {
                match lines.next_line()? {
                    LineEnd::Whole => {}
                    LineEnd::Eof | LineEnd::Partial => break,
                    LineEnd::TooLong => {
                        self.damaged = true;
                        break;
                    }
                }
                if !self.accept(lines.line(), lines.line_offset())? {
                    self.damaged = true;
                    break;
                }
                self.end = lines.offset();
            }
        }
        self.ignored = file.metadata()?.len().saturating_sub(self.end);
        Ok(())
    }

    /// Applies one whole line (without its newline) that starts at `offset`. `Ok(false)` means
    /// the line is damaged; an error means the file is of a format this build cannot read.
    fn accept(&mut self, line: &[u8], offset: u64) -> io::Result<bool> {
        let Some(line) = parse_line(line) else {
            return Ok(false);
        };
        if self.header.is_null() {
            return match line {
                Line::Header(header) => {
                    if header["v"] != json!(FORMAT_VERSION) {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "{}: session format version {} is not {FORMAT_VERSION}",
                                self.run_id, header["v"]
                            ),
                        ));
                    }
                    self.header = header;
                    Ok(true)
                }
                Line::Unknown => Ok(true),
                _ => Ok(false),
            };
        }
        match line {
            Line::Header(_) => return Ok(false),
            Line::Event { cursor, text, .. } => {
                if cursor != self.events {
                    return Ok(false);
                }
                if cursor.is_multiple_of(INDEX_STRIDE) {
                    self.index.push(offset);
                }
                self.events += 1;
                if self.tail.admits(text.len()) {
                    self.tail.push(EventText::new(&text));
                } else {
                    self.tail.skip();
                }
            }
            Line::Status(status) => self.record_status(status),
            Line::Permission(request) => self.permission = request,
            Line::Input(_) | Line::Unknown => {}
        }
        Ok(true)
    }
}

impl Drop for EventLog {
    /// An orderly end (a cancelled run's log dropped with its core) writes what was staged.
    fn drop(&mut self) {
        let _ = self.flush();
    }
}

static NULL: Value = Value::Null;

/// One event's JSON text, shared: a slice of the lines of the round it was written in (one
/// allocation per write, not one per event), or text of its own when read back from a file.
#[derive(Clone)]
pub struct EventText {
    text: Arc<str>,
    range: std::ops::Range<usize>,
}

impl EventText {
    fn new(text: &str) -> EventText {
        EventText {
            text: Arc::from(text),
            range: 0..text.len(),
        }
    }

    /// `range` of `text`; `None` if it does not fall on character boundaries inside it.
    fn slice(text: &Arc<str>, range: std::ops::Range<usize>) -> Option<EventText> {
        text.get(range.clone())?;
        Some(EventText {
            text: Arc::clone(text),
            range,
        })
    }
}

impl std::ops::Deref for EventText {
    type Target = str;

    fn deref(&self) -> &str {
        self.text.get(self.range.clone()).unwrap_or_default()
    }
}

impl fmt::Display for EventText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self)
    }
}

impl From<&str> for EventText {
    fn from(text: &str) -> EventText {
        EventText::new(text)
    }
}

/// Equal when the texts are, wherever each is kept.
impl PartialEq for EventText {
    fn eq(&self, other: &EventText) -> bool {
        **self == **other
    }
}

impl Eq for EventText {}

impl fmt::Debug for EventText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

/// The newest events of a log, contiguous and ending at its last event.
struct Tail {
    events: VecDeque<EventText>,
    /// The cursor of `events[0]`; with an empty tail, the log's length.
    start: u64,
    bytes: usize,
    max_events: usize,
    max_bytes: usize,
}

impl Tail {
    fn live() -> Tail {
        Tail::with_caps(TAIL_EVENTS, TAIL_BYTES)
    }

    /// A tail that keeps nothing, for loaded runs.
    fn none() -> Tail {
        Tail::with_caps(0, 0)
    }

    fn with_caps(max_events: usize, max_bytes: usize) -> Tail {
        Tail {
            events: VecDeque::new(),
            start: 0,
            bytes: 0,
            max_events,
            max_bytes,
        }
    }

    fn admits(&self, len: usize) -> bool {
        self.max_events > 0 && len <= self.max_bytes
    }

    fn push(&mut self, text: EventText) {
        self.bytes += text.len();
        self.events.push_back(text);
        while self.events.len() > self.max_events || self.bytes > self.max_bytes {
            let Some(old) = self.events.pop_front() else {
                break;
            };
            self.bytes -= old.len();
            self.start += 1;
        }
    }

    /// Accounts for an event not kept: the tail must stay contiguous up to the newest event,
    /// so everything older goes too.
    fn skip(&mut self) {
        let next = self.start + self.events.len() as u64 + 1;
        self.clear(next);
    }

    fn clear(&mut self, next: u64) {
        self.events.clear();
        self.bytes = 0;
        self.start = next;
    }

    fn get(&self, cursor: u64) -> Option<&EventText> {
        let i = usize::try_from(cursor.checked_sub(self.start)?).ok()?;
        self.events.get(i)
    }
}

/// The events a `read` gathers, within its limits.
struct Batch {
    events: Vec<(u64, EventText)>,
    bytes: usize,
    max_events: usize,
    max_bytes: usize,
}

impl Batch {
    /// Adds the event if it fits; the first one always does.
    fn push(&mut self, cursor: u64, text: &EventText) -> bool {
        let fits = self.events.len() < self.max_events
            && self.bytes.saturating_add(text.len()) <= self.max_bytes;
        if !fits && !self.events.is_empty() {
            return false;
        }
        self.bytes = self.bytes.saturating_add(text.len());
        self.events.push((cursor, text.clone()));
        true
    }
}

/// One parsed line of a session file.
enum Line<'a> {
    Header(Value),
    /// `text` is the event's JSON as stored, borrowed from the line when it is in the form this
    /// module writes, so cursor reads return the very bytes the live tail would.
    Event {
        cursor: u64,
        text: Cow<'a, str>,
        value: Value,
    },
    Status(Value),
    Permission(Option<Value>),
    Input(Value),
    /// A kind from a newer version, or a blank line.
    Unknown,
}

/// Parses one line (without its newline); `None` when it is damaged.
fn parse_line(line: &[u8]) -> Option<Line<'_>> {
    let text = std::str::from_utf8(line).ok()?;
    if text.trim().is_empty() {
        return Some(Line::Unknown);
    }
    let head = canonical_event_head(line);
    if let Some((cursor, body_start)) = head
        && let Some(body) = text[body_start..].strip_suffix('}')
        && let Ok(value) = serde_json::from_str::<Value>(body)
    {
        // `body` parsed as one value, so it is exactly the `event` field and the line is whole.
        return Some(Line::Event {
            cursor,
            text: Cow::Borrowed(body),
            value,
        });
    }
    let Ok(Value::Object(mut fields)) = serde_json::from_str::<Value>(text) else {
        return None;
    };
    let Some(Value::String(kind)) = fields.get("kind") else {
        return None;
    };
    let parsed = match kind.as_str() {
        "header" => Some(Line::Header(Value::Object(fields))),
        "event" => {
            let cursor = fields.get("cursor")?.as_u64()?;
            let value = fields.remove("event")?;
            Some(Line::Event {
                cursor,
                text: Cow::Owned(value.to_string()),
                value,
            })
        }
        "status" => Some(Line::Status(fields.remove("status")?)),
        "permission" => {
            let request = fields.remove("request")?;
            Some(Line::Permission((!request.is_null()).then_some(request)))
        }
        "input" => Some(Line::Input(fields.remove("input")?)),
        _ => Some(Line::Unknown),
    };
    // Reads step over lines by their head alone (`read_file`), so a line that starts as
    // event N must be event N: a repeated key that makes it another cursor or kind is damage.
    match (head, &parsed) {
        (Some((head_cursor, _)), Some(Line::Event { cursor, .. })) if *cursor == head_cursor => {
            parsed
        }
        (Some(_), _) => None,
        (None, _) => parsed,
    }
}

/// For a line that starts the way `append_event` writes one,
/// `{"kind":"event","cursor":N,"event":`, the cursor and the offset of the event's JSON. The
/// rest of the line is not checked.
fn canonical_event_head(line: &[u8]) -> Option<(u64, usize)> {
    let rest = line.strip_prefix(EVENT_LINE_PREFIX.as_bytes())?;
    let n_digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    let (digits, rest) = rest.split_at(n_digits);
    if digits.is_empty() || (digits.len() > 1 && digits[0] == b'0') {
        return None;
    }
    let cursor = std::str::from_utf8(digits).ok()?.parse().ok()?;
    rest.strip_prefix(br#","event":"#)?;
    Some((
        cursor,
        EVENT_LINE_PREFIX.len() + n_digits + br#","event":"#.len(),
    ))
}

/// Appends the event line for `event` at `cursor` to `out` and returns where the event's
/// JSON sits in `out`. An event that cannot be stored as itself becomes an `Oversized`
/// marker. On error `out` may hold part of the line; the caller cuts it off.
fn write_event_line(
    out: &mut Vec<u8>,
    cursor: u64,
    event: impl FnOnce(&mut Vec<u8>) -> io::Result<()>,
) -> io::Result<std::ops::Range<usize>> {
    let line_start = out.len();
    write!(out, "{EVENT_LINE_PREFIX}{cursor},\"event\":")?;
    let body_start = out.len();
    event(out)?;
    if out.len() - line_start + "}\n".len() > MAX_LINE_BYTES {
        let bytes = out.len() - body_start;
        out.truncate(body_start);
        serde_json::to_writer(&mut *out, &json!({"type": "Oversized", "bytes": bytes}))?;
    }
    let body = body_start..out.len();
    out.extend_from_slice(b"}\n");
    Ok(body)
}

/// `{"kind":<kind>,"cursor":<cursor>,"<field>":<value>}\n`, refused if it would be unreadable.
fn record_line(kind: &str, cursor: u64, field: &str, value: &Value) -> io::Result<String> {
    if nested_deeper_than(value, MAX_EVENT_DEPTH) {
        return Err(invalid_input(&format!(
            "{kind} record nests too deeply to be read back"
        )));
    }
    let line = format!(r#"{{"kind":"{kind}","cursor":{cursor},"{field}":{value}}}"#) + "\n";
    if line.len() > MAX_LINE_BYTES {
        return Err(invalid_input(&format!(
            "{kind} record is longer than the session line cap"
        )));
    }
    Ok(line)
}

fn header_line(run_id: &str, fields: &str) -> String {
    format!(r#"{{"kind":"header","v":{FORMAT_VERSION},"run_id":"{run_id}"{fields}}}"#) + "\n"
}

/// Whether `value` has containers nested more than `limit` deep (a scalar is depth 0, `[]`
/// depth 1). The recursion stops at `limit`, so a hostile value cannot exhaust the stack here.
fn nested_deeper_than(value: &Value, limit: usize) -> bool {
    match value {
        Value::Array(items) => limit == 0 || items.iter().any(|v| nested_deeper_than(v, limit - 1)),
        Value::Object(fields) => {
            limit == 0 || fields.values().any(|v| nested_deeper_than(v, limit - 1))
        }
        _ => false,
    }
}

/// Where a line ended, as `LineReader::next_line` reports it.
enum LineEnd {
    /// A `\n`-terminated line, now in `LineReader::line`.
    Whole,
    /// Bytes without a newline before the end of the file.
    Partial,
    /// A line longer than `MAX_LINE_BYTES`; reading stops there.
    TooLong,
    Eof,
}

/// Whole lines of `[start, end)` of a file, read with `pread` so a shared descriptor's offset
/// is never moved, and each line capped at `MAX_LINE_BYTES`.
struct LineReader<'f> {
    reader: BufReader<Pread<'f>>,
    line: Vec<u8>,
    /// Where the line in `line` starts.
    line_offset: u64,
    /// Where the next line starts.
    offset: u64,
}

impl<'f> LineReader<'f> {
    fn new(file: &'f File, start: u64, end: u64) -> LineReader<'f> {
        LineReader {
            reader: BufReader::with_capacity(
                READ_BUF_BYTES,
                Pread {
                    file,
                    pos: start,
                    end,
                },
            ),
            line: Vec::new(),
            line_offset: start,
            offset: start,
        }
    }

    /// The last whole line read, without its newline.
    fn line(&self) -> &[u8] {
        &self.line
    }

    fn line_offset(&self) -> u64 {
        self.line_offset
    }

    fn offset(&self) -> u64 {
        self.offset
    }

    fn next_line(&mut self) -> io::Result<LineEnd> {
        self.line.clear();
        loop {
            let buf = match self.reader.fill_buf() {
                Ok(buf) => buf,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => return Err(error),
            };
            if buf.is_empty() {
                return Ok(if self.line.is_empty() {
                    LineEnd::Eof
                } else {
                    LineEnd::Partial
                });
            }
            let newline = buf.iter().position(|&b| b == b'\n');
            let take = newline.unwrap_or(buf.len());
            // The cap counts the newline, so content may be one byte shorter than it.
            if self.line.len() + take >= MAX_LINE_BYTES {
                return Ok(LineEnd::TooLong);
            }
            self.line.extend_from_slice(&buf[..take]);
            match newline {
                Some(_) => {
                    self.reader.consume(take + 1);
                    self.line_offset = self.offset;
                    self.offset += self.line.len() as u64 + 1;
                    return Ok(LineEnd::Whole);
                }
                None => self.reader.consume(take),
            }
        }
    }
}

/// `Read` over `[pos, end)` of a file by `pread`.
struct Pread<'f> {
    file: &'f File,
    pos: u64,
    end: u64,
}

impl Read for Pread<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.end.saturating_sub(self.pos);
        let want = usize::try_from(left).map_or(buf.len(), |left| left.min(buf.len()));
        if want == 0 {
            return Ok(0);
        }
        let n_bytes = self.file.read_at(&mut buf[..want], self.pos)?;
        self.pos += n_bytes as u64;
        Ok(n_bytes)
    }
}

/// A detached log's sync, to run off the event loop.
struct PendingSync {
    file: File,
    /// The directory to sync too: the first sync of a new file makes its name durable.
    dir: Option<PathBuf>,
    run_id: String,
}

impl PendingSync {
    fn run(self) {
        if let Err(e) = sync_to_disk(&self.file, self.dir.as_deref()) {
            log::warn(&format!(
                "{}: cannot flush the session file to disk: {e}",
                self.run_id
            ));
        }
    }
}

/// `fsync`s the file's data and, when given, its directory (so the file's name survives too).
fn sync_to_disk(file: &File, dir: Option<&Path>) -> io::Result<()> {
    file.sync_data()?;
    if let Some(dir) = dir {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Takes the exclusive append lock, refusing if another process holds it. A file system
/// without `flock` support gets no lock rather than no session.
fn lock_for_append(file: &File, run_id: &str) -> io::Result<()> {
    match file.try_lock() {
        Ok(()) => Ok(()),
        Err(TryLockError::WouldBlock) => Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            format!("{run_id}: session file is being written by another process"),
        )),
        Err(TryLockError::Error(error)) if error.kind() == io::ErrorKind::Unsupported => Ok(()),
        Err(TryLockError::Error(error)) => Err(error),
    }
}

/// A writer id as `take_writer_lock` makes them (`<pid>-<nanoseconds>`), so a header's
/// `writer` can only ever name a file in the writers directory.
fn is_writer_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 48 && id.bytes().all(|b| b.is_ascii_digit() || b == b'-')
}

/// Takes this store's writer lock in `<dir>/.writers`, first removing the lock files of
/// writers that are gone (unlocked). The file is locked under a temporary name and renamed
/// into place, so a `.lock` file is never seen unlocked while its writer lives. `None` where
/// the file system has no `flock`.
fn take_writer_lock(dir: &Path) -> io::Result<Option<(Arc<str>, File)>> {
    let writers = dir.join(WRITERS_DIR);
    DirBuilder::new()
        .mode(0o700)
        .recursive(true)
        .create(&writers)?;
    for entry in fs::read_dir(&writers)?.flatten() {
        let path = entry.path();
        let stale = File::open(&path).is_ok_and(|file| file.try_lock().is_ok());
        if stale {
            let _ = fs::remove_file(&path);
        }
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let id = format!("{}-{nanos}", std::process::id());
    let temporary = writers.join(format!("{id}.tmp"));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(TryLockError::Error(e)) if e.kind() == io::ErrorKind::Unsupported => {
            let _ = fs::remove_file(&temporary);
            return Ok(None);
        }
        Err(TryLockError::Error(e)) => return Err(e),
        Err(TryLockError::WouldBlock) => {
            return Err(io::Error::other("a fresh lock file is locked"));
        }
    }
    fs::rename(&temporary, writers.join(format!("{id}.lock")))?;
    Ok(Some((id.into(), file)))
}

/// A user message from a header's `prompt` and `images` or an input's `text` and
/// `images`; nothing when both are empty.
fn push_user_text(messages: &mut Vec<Value>, record: &Value, text_key: &str) {
    let mut content = Vec::new();
    if let Some(text) = record[text_key].as_str().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    if let Some(images) = record.get("images").and_then(Value::as_array) {
        content.extend(images.iter().cloned());
    }
    if !content.is_empty() {
        messages.push(json!({"role": "user", "content": content}));
    }
}

/// The highest run number among the directory's run files.
/// Holds the highest run number ever allocated in a sessions directory.
const HIGH_WATER_FILE: &str = ".last-run";

fn max_run_number(dir: &Path) -> io::Result<Option<u64>> {
    let mut max = fs::read_to_string(dir.join(HIGH_WATER_FILE))
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    for entry in fs::read_dir(dir)? {
        let Ok(entry) = entry else {
            continue;
        };
        let file_name = entry.file_name();
        let number = file_name
            .to_str()
            .and_then(|name| name.strip_suffix(".jsonl"))
            .and_then(run_number);
        max = max.max(number);
    }
    Ok(max)
}

fn check_run_id(run_id: &str) -> io::Result<()> {
    match run_number(run_id) {
        Some(_) => Ok(()),
        None => Err(invalid_input(&format!(
            "invalid run id {:?}: expected run-<number>",
            truncate_chars(run_id, 64)
        ))),
    }
}

fn truncate_chars(text: &str, max: usize) -> &str {
    text.char_indices()
        .nth(max)
        .map_or(text, |(cut, _)| &text[..cut])
}

fn invalid_input(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.to_owned())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static COUNTER: AtomicU32 = AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir().join(format!(
                "caliban-session-test-{}-{name}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&path);
            TempDir(path)
        }

        fn store(&self, sub: &str) -> SessionStore {
            SessionStore::open(self.0.join(sub)).expect("open store")
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// xorshift64: reproducible randomness without a dependency.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    fn header(prompt: &str) -> Map<String, Value> {
        let Value::Object(fields) = json!({
            "interactive": false, "prompt": prompt, "cwd": "/abs",
            "model": "claude-test", "provider": "anthropic",
        }) else {
            unreachable!("a json! object literal is an object")
        };
        fields
    }

    fn delta(i: usize, text: &str) -> Value {
        json!({"type": "AssistantTextDelta", "turn_index": 0, "content_block_index": 0,
               "text": format!("{i}:{text}")})
    }

    /// Every event of `log`, checking that cursors are dense from 0.
    fn all_events(log: &EventLog) -> Vec<String> {
        let events = log.read(0, usize::MAX, usize::MAX).expect("read all");
        for (i, (cursor, _)) in events.iter().enumerate() {
            assert_eq!(*cursor, i as u64);
        }
        events
            .into_iter()
            .map(|(_, text)| text.to_string())
            .collect()
    }

    /// What a read of `reference` from `cursor` must return.
    fn expected_read(
        reference: &[String],
        cursor: u64,
        max_events: usize,
        max_bytes: usize,
    ) -> Vec<(u64, String)> {
        let mut out = Vec::new();
        let mut bytes = 0;
        for (i, text) in reference.iter().enumerate().skip(cursor as usize) {
            let fits = out.len() < max_events && bytes + text.len() <= max_bytes;
            if !fits && !out.is_empty() {
                break;
            }
            bytes += text.len();
            out.push((i as u64, text.clone()));
        }
        out
    }

    fn owned(batch: Vec<(u64, EventText)>) -> Vec<(u64, String)> {
        batch.into_iter().map(|(c, t)| (c, t.to_string())).collect()
    }

    #[test]
    fn run_numbers_below_keeps_only_a_page() {
        let tmp = TempDir::new("numbers-below");
        let store = tmp.store("s");
        let dir = tmp.0.join("s");
        for n in [3u64, 10, 1, 7, 12, 5] {
            fs::write(dir.join(format!("run-{n}.jsonl")), "").unwrap();
        }
        fs::write(dir.join("run-07.jsonl"), "").unwrap();
        fs::write(dir.join("notes.txt"), "").unwrap();
        let page = |below, limit| store.run_numbers_below(below, limit).unwrap();
        assert_eq!(page(None, 10), (vec![1, 3, 5, 7, 10, 12], false));
        assert_eq!(page(None, 2), (vec![10, 12], true));
        assert_eq!(page(Some(10), 2), (vec![5, 7], true));
        assert_eq!(page(Some(3), 2), (vec![1], false));
        assert_eq!(page(Some(1), 2), (vec![], false));
    }

    #[test]
    fn round_trip() {
        let tmp = TempDir::new("round-trip");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("fix the bug")).unwrap();
        assert_eq!(log.run_id(), "run-1");
        assert!(log.is_empty());
        assert_eq!(log.header()["kind"], "header");
        assert_eq!(log.header()["v"], 1);
        assert_eq!(log.header()["prompt"], "fix the bug");
        assert!(log.header()["created_ms"].as_u64().unwrap() > 1_600_000_000_000);

        log.append_status(&json!({"state": "running"})).unwrap();
        let first = delta(0, "héllo \"world\"\n");
        assert_eq!(log.append_event(&first).unwrap(), 0);
        let request = json!({"tool_use_id": "toolu_1", "tool_name": "Bash",
                             "input": {"command": "ls"}});
        log.append_permission(Some(&request)).unwrap();
        assert_eq!(log.last_permission(), Some(&request));
        log.append_permission(None).unwrap();
        assert_eq!(log.last_permission(), None);
        assert_eq!(log.append_event(&delta(1, "x")).unwrap(), 1);
        log.append_input(&json!({"type": "end_input"})).unwrap();
        log.append_status(&json!({"state": "done"})).unwrap();
        log.sync().unwrap();
        assert_eq!(log.len(), 2);

        let text = fs::read_to_string(log.path()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with(r#"{"kind":"header","v":1,"run_id":"run-1","#));
        assert_eq!(
            lines[1],
            r#"{"kind":"status","cursor":0,"status":{"state":"running"}}"#
        );
        assert_eq!(
            lines[2],
            format!(r#"{{"kind":"event","cursor":0,"event":{first}}}"#)
        );
        assert_eq!(
            lines[4],
            r#"{"kind":"permission","cursor":1,"request":null}"#
        );
        assert_eq!(
            lines[6],
            r#"{"kind":"input","cursor":2,"input":{"type":"end_input"}}"#
        );
        assert!(text.ends_with('\n'));
        assert_eq!(mode_of(log.path()) & 0o777, 0o600);

        let expected = vec![first.to_string(), delta(1, "x").to_string()];
        assert_eq!(all_events(&log), expected);
        let loaded = store.load("run-1").unwrap();
        assert_eq!(loaded.header(), log.header());
        assert_eq!(loaded.len(), 2);
        assert_eq!(all_events(&loaded), expected);
        assert_eq!(loaded.last_status(), Some(&json!({"state": "done"})));
        assert_eq!(loaded.last_permission(), None);
        assert_eq!(loaded.ignored_bytes(), 0);
        assert!(log.read(2, 10, 10).unwrap().is_empty());
        assert!(loaded.read(99, 10, 10).unwrap().is_empty());

        let listed = store.list().unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].run_id, "run-1");
        assert_eq!(listed[0].events, 2);
        assert_eq!(listed[0].header, *log.header());
        assert_eq!(listed[0].status, Some(json!({"state": "done"})));
        assert!(listed[0].modified_ms > 0);

        assert_eq!(store.create(Map::new()).unwrap().run_id(), "run-2");
        // While its writer holds the file, a run cannot be deleted (by anyone).
        assert_eq!(
            store.delete("run-1").unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        drop(log);
        store.delete("run-1").unwrap();
        assert_eq!(store.list().unwrap().len(), 1);
        assert_eq!(
            store.load("run-1").unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn reads_across_the_tail_and_the_file_match_a_reference() {
        let tmp = TempDir::new("tail");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        let mut reference = Vec::new();
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for i in 0..1500 {
            // Every so often a big event, so the byte cap evicts as well as the count cap.
            let size = match i % 37 {
                0 => 40_000 + rng.below(30_000) as usize,
                _ => rng.below(200) as usize,
            };
            let event = delta(i, &"é".repeat(size / 2));
            assert_eq!(log.append_event(&event).unwrap(), i as u64);
            reference.push(event.to_string());
            if i % 10 == 0 {
                log.append_status(&json!({"state": "running", "i": i}))
                    .unwrap();
            }
            assert!(log.tail.events.len() <= TAIL_EVENTS);
            assert!(log.tail.bytes <= TAIL_BYTES);
            assert_eq!(log.tail.start + log.tail.events.len() as u64, log.len());
        }
        assert!(log.tail.start > 0, "the tail must have dropped old events");
        assert!(log.index.len() as u64 == 1500_u64.div_ceil(INDEX_STRIDE));

        let loaded = store.load(log.run_id()).unwrap();
        for _ in 0..600 {
            let cursor = rng.below(1510);
            let max_events = 1 + rng.below(300) as usize;
            let max_bytes = rng.below(150_000) as usize;
            let expected = expected_read(&reference, cursor, max_events, max_bytes);
            assert_eq!(
                owned(log.read(cursor, max_events, max_bytes).unwrap()),
                expected
            );
            assert_eq!(
                owned(loaded.read(cursor, max_events, max_bytes).unwrap()),
                expected
            );
        }
        // A read that starts in the file and runs on into the tail.
        let start = log.tail.start - 3;
        let expected = expected_read(&reference, start, 10, usize::MAX);
        assert_eq!(owned(log.read(start, 10, usize::MAX).unwrap()), expected);
        assert_eq!(all_events(&log), reference);

        log.release_tail();
        assert!(log.tail.events.is_empty());
        assert_eq!(all_events(&log), reference);
        log.append_event(&delta(1500, "after")).unwrap();
        reference.push(delta(1500, "after").to_string());
        assert_eq!(all_events(&log), reference);
        log.close().unwrap();
        assert_eq!(all_events(&log), reference);
    }

    /// One state per line written: where the line ends and what a reader must see up to it.
    struct Checkpoint {
        end: u64,
        events: usize,
        status: Option<Value>,
        permission: Option<Value>,
    }

    fn checkpoint(log: &EventLog) -> Checkpoint {
        Checkpoint {
            end: log.end,
            events: log.len() as usize,
            status: log.last_status().cloned(),
            permission: log.last_permission().cloned(),
        }
    }

    #[test]
    fn a_crash_at_any_byte_leaves_a_readable_prefix() {
        let tmp = TempDir::new("crash");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("fix the bug ✓")).unwrap();
        let mut reference = Vec::new();
        let mut checkpoints = vec![checkpoint(&log)];
        log.append_status(&json!({"state": "running"})).unwrap();
        checkpoints.push(checkpoint(&log));
        for i in 0..12 {
            let event = delta(i, "héllo \"wörld\"\n{}");
            log.append_event(&event).unwrap();
            reference.push(event.to_string());
            checkpoints.push(checkpoint(&log));
            if i % 4 == 1 {
                let request = json!({"tool_use_id": format!("t{i}"), "tool_name": "Bash",
                                     "input": {"command": "ls"}});
                log.append_permission(Some(&request)).unwrap();
                checkpoints.push(checkpoint(&log));
                log.append_input(&json!({"type": "user_message", "text": "go on"}))
                    .unwrap();
                checkpoints.push(checkpoint(&log));
                log.append_permission(None).unwrap();
                checkpoints.push(checkpoint(&log));
            }
        }
        log.append_status(&json!({"state": "done"})).unwrap();
        checkpoints.push(checkpoint(&log));
        let bytes = fs::read(log.path()).unwrap();
        assert_eq!(bytes.len() as u64, log.end);

        let cut_store = tmp.store("cut");
        let path = cut_store.dir().join("run-1.jsonl");
        for len in 0..=bytes.len() {
            fs::write(&path, &bytes[..len]).unwrap();
            let loaded = cut_store
                .load("run-1")
                .unwrap_or_else(|e| panic!("a {len}-byte prefix failed to load: {e}"));
            let Some(state) = checkpoints.iter().rev().find(|c| c.end <= len as u64) else {
                assert_eq!(loaded.header(), &Value::Null, "at {len} bytes");
                assert_eq!(loaded.len(), 0);
                assert_eq!(loaded.ignored_bytes(), len as u64);
                continue;
            };
            assert_eq!(loaded.header(), log.header(), "at {len} bytes");
            assert_eq!(loaded.len(), state.events as u64, "at {len} bytes");
            assert_eq!(
                all_events(&loaded),
                reference[..state.events],
                "at {len} bytes"
            );
            assert_eq!(
                loaded.last_status(),
                state.status.as_ref(),
                "at {len} bytes"
            );
            assert_eq!(loaded.last_permission(), state.permission.as_ref());
            assert_eq!(loaded.ignored_bytes(), len as u64 - state.end);
            assert!(!loaded.damaged);
            loaded.messages().unwrap();
        }
        // The same prefixes read through `list`, which must never fail either.
        assert_eq!(cut_store.list().unwrap()[0].events, reference.len() as u64);
    }

    #[test]
    fn flipped_bytes_never_panic() {
        let tmp = TempDir::new("flip");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        for i in 0..4 {
            log.append_event(&delta(i, "abc")).unwrap();
            log.append_status(&json!({"state": "running"})).unwrap();
        }
        let bytes = fs::read(log.path()).unwrap();
        let path = tmp.0.join("flip/run-1.jsonl");
        let flip_store = tmp.store("flip");
        for i in 0..bytes.len() {
            for replacement in [b'\n', b'"', b'}', 0xff, b'7'] {
                let mut damaged = bytes.clone();
                damaged[i] = replacement;
                fs::write(&path, &damaged).unwrap();
                // A flip in the header's "v" is a clean error; anything else loads a prefix.
                if let Ok(loaded) = flip_store.load("run-1") {
                    assert!(loaded.len() <= 4);
                    let _ = loaded.read(0, usize::MAX, usize::MAX);
                    let _ = loaded.messages();
                }
                let _ = flip_store.list().unwrap();
            }
        }
    }

    #[test]
    fn damage_in_the_middle_ends_the_readable_prefix() {
        let tmp = TempDir::new("garbage");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        let mut reference = Vec::new();
        for i in 0..5 {
            log.append_event(&delta(i, "x")).unwrap();
            reference.push(delta(i, "x").to_string());
        }
        let good = fs::read(log.path()).unwrap();
        let gap = format!(r#"{{"kind":"event","cursor":7,"event":{}}}"#, delta(7, "x")) + "\n";
        let long = "x".repeat(MAX_LINE_BYTES) + "\n";
        let unknown =
            r#"{"kind":"bookmark","cursor":5,"note":"from the future"}"#.to_owned() + "\n";
        let dir = tmp.store("cut");
        let path = dir.dir().join("run-1.jsonl");
        for (damage, damaged) in [
            ("garbage\n", true),
            (&gap, true),
            (&long, true),
            (&unknown, false),
        ] {
            let mut bytes = good.clone();
            bytes.extend_from_slice(damage.as_bytes());
            let after = format!(r#"{{"kind":"event","cursor":5,"event":{}}}"#, delta(5, "x"));
            bytes.extend_from_slice((after + "\n").as_bytes());
            fs::write(&path, &bytes).unwrap();
            let mut loaded = dir.load("run-1").unwrap();
            assert_eq!(loaded.damaged, damaged);
            if damaged {
                assert_eq!(all_events(&loaded), reference);
                assert_eq!(loaded.ignored_bytes(), (bytes.len() - good.len()) as u64);
                assert_eq!(loaded.refresh().unwrap(), 0);
                let err = loaded
                    .append_status(&json!({"state": "failed"}))
                    .unwrap_err();
                assert_eq!(err.kind(), io::ErrorKind::InvalidData);
                assert_eq!(
                    fs::read(&path).unwrap(),
                    bytes,
                    "a damaged file is left alone"
                );
            } else {
                // Unknown kinds are skipped, not fatal.
                assert_eq!(loaded.len(), 6);
                assert_eq!(loaded.ignored_bytes(), 0);
            }
        }
    }

    #[test]
    fn a_line_whose_json_disagrees_with_its_event_head_is_damage() {
        // Found by fuzz/session_file: with a repeated key the whole-line parse read another
        // cursor (or kind) than the head that reads skip lines by, so the load counted an
        // event that reading then refused as "changed underneath".
        let tmp = TempDir::new("disagree");
        let store = tmp.store("sessions");
        let path = store.dir().join("run-1.jsonl");
        let header = r#"{"kind":"header","v":1,"run_id":"run-1"}"#;
        let first = r#"{"kind":"event","cursor":0,"event":{"n":0}}"#;
        for line in [
            r#"{"kind":"event","cursor":0,"event":{"n":1},"cursor":1}"#,
            r#"{"kind":"event","cursor":1,"event":{"n":1},"kind":"status","status":{}}"#,
        ] {
            fs::write(&path, format!("{header}\n{first}\n{line}\n")).unwrap();
            let log = store.load("run-1").unwrap();
            for cursor in 0..log.len() {
                log.read(cursor, 1, 0).expect("every counted event reads");
            }
            assert_eq!(all_events(&log), [r#"{"n":0}"#], "{line}");
            assert!(log.damaged, "{line}");
            assert_eq!(log.last_status(), None);
        }
    }

    #[test]
    fn an_oversized_event_becomes_a_marker_and_cursors_stay_dense() {
        let tmp = TempDir::new("oversized");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        // An event whose line is exactly the cap is stored as is; one byte more is not.
        let mut line = Vec::new();
        write_event_line(&mut line, 1, |out| {
            Ok(serde_json::to_writer(out, &delta(1, ""))?)
        })
        .unwrap();
        let overhead = line.len();
        let fits = delta(1, &"a".repeat(MAX_LINE_BYTES - overhead));
        let huge = delta(2, &"a".repeat(MAX_LINE_BYTES - overhead + 1));
        let deep_ok = (0..MAX_EVENT_DEPTH - 1).fold(json!(1), |v, _| json!([v]));
        let deep_ok = json!({ "type": "Deep", "v": deep_ok });
        let too_deep = json!({ "type": "Deep", "v": [deep_ok["v"].clone()] });
        assert_eq!(log.append_event(&delta(0, "small")).unwrap(), 0);
        assert_eq!(log.append_event(&fits).unwrap(), 1);
        assert_eq!(log.append_event(&huge).unwrap(), 2);
        assert_eq!(log.append_event(&deep_ok).unwrap(), 3);
        assert_eq!(log.append_event(&too_deep).unwrap(), 4);
        assert_eq!(log.append_event(&delta(5, "small")).unwrap(), 5);

        let marker = json!({"type": "Oversized", "bytes": huge.to_string().len()}).to_string();
        let depth_marker = json!({"type": "Oversized", "max_depth": MAX_EVENT_DEPTH}).to_string();
        let expected = vec![
            delta(0, "small").to_string(),
            fits.to_string(),
            marker,
            deep_ok.to_string(),
            depth_marker,
            delta(5, "small").to_string(),
        ];
        assert_eq!(all_events(&log), expected);
        let loaded = store.load("run-1").unwrap();
        assert_eq!(all_events(&loaded), expected);
        assert_eq!(loaded.ignored_bytes(), 0);
        // A big event is always returned alone, whatever max_bytes says.
        assert_eq!(log.read(1, 10, 1).unwrap().len(), 1);
        assert_eq!(
            loaded.read(1, 10, 1).unwrap()[0].1.len(),
            fits.to_string().len()
        );

        let err = log.append_input(&json!({"type": "user_message",
                                           "text": "a".repeat(MAX_LINE_BYTES)}));
        assert_eq!(err.unwrap_err().kind(), io::ErrorKind::InvalidInput);
        assert_eq!(log.len(), 6);
    }

    #[test]
    fn create_skips_numbers_other_writers_took() {
        let tmp = TempDir::new("collide");
        let dir = tmp.0.join("sessions");
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("run-7.jsonl"), b"").unwrap();
        fs::write(dir.join("run-0100.jsonl"), b"").unwrap(); // not a run id: ignored
        let mut first = SessionStore::open(dir.clone()).unwrap();
        let mut second = SessionStore::open(dir.clone()).unwrap();
        assert_eq!(first.create(header("a")).unwrap().run_id(), "run-8");
        assert_eq!(second.create(header("b")).unwrap().run_id(), "run-9");
        fs::write(dir.join("run-20.jsonl"), b"").unwrap();
        assert_eq!(first.create(header("c")).unwrap().run_id(), "run-21");
        assert_eq!(first.create(header("d")).unwrap().run_id(), "run-22");
        assert_eq!(first.load("run-8").unwrap().header()["prompt"], "a");
        assert_eq!(first.load("run-9").unwrap().header()["prompt"], "b");
    }

    fn mode_of(path: &Path) -> u32 {
        std::os::unix::fs::PermissionsExt::mode(&fs::metadata(path).unwrap().permissions())
    }

    #[test]
    fn list_skips_unreadable_files_and_sorts_by_number() {
        let tmp = TempDir::new("list");
        let mut store = tmp.store("sessions");
        let dir = store.dir().to_owned();
        assert_eq!(mode_of(&dir) & 0o777, 0o700);
        for _ in 0..10 {
            let mut log = store.create(header("p")).unwrap();
            log.append_event(&delta(0, "x")).unwrap();
            log.append_permission(Some(&json!({"tool_use_id": "t"})))
                .unwrap();
        }
        fs::write(dir.join("run-9.jsonl"), b"\x00\xffnot json\n").unwrap();
        fs::remove_file(dir.join("run-3.jsonl")).unwrap();
        fs::create_dir(dir.join("run-3.jsonl")).unwrap();
        fs::write(dir.join("run-4.jsonl"), b"{\"kind\":\"header\",\"v\":2}\n").unwrap();
        fs::write(dir.join("notes.jsonl"), b"{}\n").unwrap();
        fs::write(dir.join("run-05.jsonl"), b"{}\n").unwrap();
        let listed = store.list().unwrap();
        let ids: Vec<&str> = listed.iter().map(|s| s.run_id.as_str()).collect();
        assert_eq!(
            ids,
            [
                "run-1", "run-2", "run-5", "run-6", "run-7", "run-8", "run-9", "run-10"
            ]
        );
        let corrupt = &listed[6];
        assert_eq!((&corrupt.header, corrupt.events), (&Value::Null, 0));
        let good = &listed[7];
        assert_eq!(good.events, 1);
        assert_eq!(good.permission, Some(json!({"tool_use_id": "t"})));
        assert_eq!(good.status, None);
        assert_eq!(good.header["run_id"], "run-10");
        let logs = store.list_logs().unwrap();
        assert_eq!(logs.len(), 8);
        assert_eq!(all_events(&logs[7].1), [delta(0, "x").to_string()]);
        let err = store.load("run-4").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn run_ids_that_could_escape_the_dir_are_rejected() {
        let tmp = TempDir::new("escape");
        let store = tmp.store("sessions");
        fs::write(tmp.0.join("secret.jsonl"), b"{}\n").unwrap();
        for bad in [
            "../secret",
            "run-1/../../secret",
            "run-",
            "run-1a",
            "run-+1",
            "run--1",
            "run-01",
            "run-1.jsonl",
            "/etc/passwd",
            "",
            "run-1\0",
            "run-99999999999999999999999",
        ] {
            assert_eq!(
                store.load(bad).unwrap_err().kind(),
                io::ErrorKind::InvalidInput,
                "{bad:?}"
            );
            assert_eq!(
                store.delete(bad).unwrap_err().kind(),
                io::ErrorKind::InvalidInput
            );
        }
        assert!(tmp.0.join("secret.jsonl").exists());
        assert_eq!(run_number("run-0"), Some(0));
        assert_eq!(run_number("run-42"), Some(42));
        assert_eq!(run_number("run-18446744073709551615"), Some(u64::MAX));
    }

    #[test]
    fn messages_rebuild_the_conversation() {
        let tmp = TempDir::new("messages");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("list files")).unwrap();
        let user =
            |text: &str| json!({"role": "user", "content": [{"type": "text", "text": text}]});
        let assistant = json!({"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]});
        let results = json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]});
        let reply = json!({"role": "assistant", "content": [{"type": "text", "text": "a.txt"}]});
        let turn_end = |i: u32, message: &Value, results: Vec<Value>| {
            json!({"type": "TurnEnd", "turn_index": i, "assistant_message": message,
                   "tool_results": results, "stop_reason": "end_turn",
                   "usage": {"input_tokens": 1, "output_tokens": 1}, "ttft": null, "tbt": null})
        };
        log.append_event(
            &json!({"type": "TurnStart", "turn_index": 0, "message_id": "m",
                                  "model": "x"}),
        )
        .unwrap();
        log.append_event(&turn_end(0, &assistant, vec![results.clone()]))
            .unwrap();
        log.append_event(&turn_end(1, &reply, vec![])).unwrap();
        log.append_input(&json!({"type": "user_message", "text": "thanks"}))
            .unwrap();
        log.append_input(&json!({"type": "user_message", "text": ""}))
            .unwrap();
        log.append_event(&turn_end(2, &reply, vec![])).unwrap();
        log.append_input(&json!({"type": "end_input"})).unwrap();
        log.append_event(&json!({"type": "RunEnd", "final_messages": []}))
            .unwrap();
        let expected = vec![
            user("list files"),
            assistant,
            results,
            reply.clone(),
            user("thanks"),
            reply,
        ];
        assert_eq!(log.messages().unwrap(), expected);
        assert_eq!(store.load("run-1").unwrap().messages().unwrap(), expected);
    }

    #[test]
    fn a_loaded_log_follows_a_file_being_written() {
        let tmp = TempDir::new("follow");
        let mut store = tmp.store("sessions");
        let mut writer = store.create(header("p")).unwrap();
        let mut reference = Vec::new();
        for i in 0..100 {
            writer.append_event(&delta(i, "x")).unwrap();
            reference.push(delta(i, "x").to_string());
        }
        let mut reader = store.load("run-1").unwrap();
        assert_eq!(reader.len(), 100);
        for i in 100..250 {
            writer.append_event(&delta(i, "y")).unwrap();
            reference.push(delta(i, "y").to_string());
        }
        writer.append_status(&json!({"state": "done"})).unwrap();
        assert_eq!(reader.refresh().unwrap(), 150);
        assert_eq!(reader.last_status(), Some(&json!({"state": "done"})));
        assert_eq!(all_events(&reader), reference);
        assert_eq!(writer.refresh().unwrap(), 0);

        // A line caught half-written is ignored until it is whole.
        let line = format!(
            r#"{{"kind":"event","cursor":250,"event":{}}}"#,
            delta(250, "z")
        );
        let path = tmp.store("half").dir().join("run-1.jsonl");
        let mut bytes = fs::read(writer.path()).unwrap();
        bytes.extend_from_slice(&line.as_bytes()[..20]);
        fs::write(&path, &bytes).unwrap();
        let mut half = SessionStore::open(path.parent().unwrap().to_owned())
            .unwrap()
            .load("run-1")
            .unwrap();
        assert_eq!((half.len(), half.ignored_bytes()), (250, 20));
        let mut file = OpenOptions::new().append(true).open(&path).unwrap();
        file.write_all(&line.as_bytes()[20..]).unwrap();
        assert_eq!(half.refresh().unwrap(), 0);
        file.write_all(b"\n").unwrap();
        assert_eq!(half.refresh().unwrap(), 1);
        assert_eq!((half.len(), half.ignored_bytes()), (251, 0));
    }

    #[test]
    fn an_idle_run_holds_no_descriptor_yet_stays_its_writers() {
        let tmp = TempDir::new("idle");
        let mut first = tmp.store("sessions");
        let mut run = first.create(header("p")).unwrap();
        run.append_event(&delta(0, "x")).unwrap();
        first.idle(&mut run);
        assert!(matches!(run.access, Access::Detached));
        // A second server on the directory finds the file unlocked, but the run's writer
        // still lives: it may neither mark the run interrupted nor delete it.
        let second = tmp.store("sessions");
        let mut seen = second.load("run-1").unwrap();
        assert!(second.written_elsewhere(&seen));
        let err = seen.append_status(&json!({"state": "failed"})).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert_eq!(
            second.delete("run-1").unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        // The writer goes on where it stopped, taking the file again.
        run.append_event(&delta(1, "x")).unwrap();
        assert!(matches!(run.access, Access::Append(_)));
        first.idle(&mut run);
        assert_eq!(all_events(&first.load("run-1").unwrap()).len(), 2);
        // Once the writer is gone (its store dropped, or its process dead), the run is
        // anyone's to end, and a dead writer's lock file is swept by the next store.
        drop(run);
        drop(first);
        let mut seen = second.load("run-1").unwrap();
        assert!(!second.written_elsewhere(&seen));
        seen.append_status(&json!({"state": "failed"})).unwrap();
        let writers = tmp.0.join("sessions").join(WRITERS_DIR);
        let stale = writers.join("1-1.lock");
        fs::write(&stale, "").unwrap();
        // A store takes its writer lock with its first run, sweeping the stale ones then.
        let mut third = tmp.store("sessions");
        assert!(stale.exists());
        third.create(header("q")).unwrap();
        assert!(!stale.exists(), "an unlocked writer lock is swept");
        assert_eq!(fs::read_dir(&writers).unwrap().count(), 1);
    }

    #[test]
    fn appending_to_a_loaded_run_trims_a_partial_line_and_respects_the_writer_lock() {
        let tmp = TempDir::new("append-loaded");
        let mut store = tmp.store("sessions");
        let mut writer = store.create(header("p")).unwrap();
        writer.append_event(&delta(0, "x")).unwrap();
        let mut other = store.load("run-1").unwrap();
        let err = other
            .append_status(&json!({"state": "failed"}))
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        writer.append_event(&delta(1, "x")).unwrap();
        writer.close().unwrap();
        // The writer let go: the other log catches up, then appends after the last line.
        other.append_status(&json!({"state": "failed"})).unwrap();
        assert_eq!(other.len(), 2);
        other.close().unwrap();

        // A crash left half a line: it is cut before the next line goes out.
        let mut bytes = fs::read(other.path()).unwrap();
        bytes.extend_from_slice(br#"{"kind":"event","cursor":2,"ev"#);
        fs::write(other.path(), &bytes).unwrap();
        let mut crashed = store.load("run-1").unwrap();
        assert_eq!(crashed.ignored_bytes(), 30);
        crashed
            .append_status(&json!({"state": "failed", "error": "interrupted"}))
            .unwrap();
        crashed.append_event(&delta(2, "x")).unwrap();
        crashed.sync().unwrap();
        let reloaded = store.load("run-1").unwrap();
        assert_eq!(reloaded.ignored_bytes(), 0);
        assert_eq!(reloaded.len(), 3);
        assert_eq!(reloaded.last_status().unwrap()["error"], "interrupted");
        assert_eq!(all_events(&reloaded)[2], delta(2, "x").to_string());
        // A log that has its own descriptor holds the lock now.
        let mut third = store.load("run-1").unwrap();
        assert!(third.append_status(&json!({"state": "done"})).is_err());
    }

    #[test]
    fn a_failed_append_changes_nothing_and_poisons_an_uncuttable_file() {
        let tmp = TempDir::new("full");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        log.append_event(&delta(0, "x")).unwrap();
        // Writes to /dev/full fail with ENOSPC, and a device cannot be truncated either.
        let Ok(full) = OpenOptions::new().read(true).append(true).open("/dev/full") else {
            return;
        };
        log.access = Access::Append(full);
        assert!(log.append_event(&delta(1, "x")).is_err());
        assert!(matches!(log.access, Access::Poisoned(_)));
        assert_eq!(log.len(), 1);
        assert_eq!(log.read(0, 10, 1000).unwrap().len(), 1);
        let err = log.append_status(&json!({"state": "done"})).unwrap_err();
        assert!(err.to_string().contains("failed part-way"), "{err}");
        assert_eq!(log.last_status(), None);
    }

    #[test]
    fn a_stopped_log_refuses_appends_and_still_reads() {
        let tmp = TempDir::new("stopped");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        log.append_event(&delta(0, "x")).unwrap();
        let size = fs::metadata(log.path()).unwrap().len();
        log.stop_appending();
        assert!(log.stage_event(&delta(1, "x")).is_err());
        assert!(log.append_status(&json!({"state": "done"})).is_err());
        assert!(log.append_input(&json!({"type": "end_input"})).is_err());
        assert_eq!(fs::metadata(log.path()).unwrap().len(), size);
        assert_eq!((log.len(), all_events(&log).len()), (1, 1));
    }

    #[test]
    fn staged_events_are_shown_once_written_in_one_line_run() {
        let tmp = TempDir::new("staged");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        let size = |log: &EventLog| fs::metadata(log.path()).unwrap().len();
        let before = size(&log);
        assert_eq!(log.stage_event(&delta(0, "a")).unwrap(), 0);
        assert_eq!(log.stage_event(&delta(1, "b")).unwrap(), 1);
        // Neither in the file nor shown yet.
        assert_eq!((log.len(), size(&log)), (0, before));
        assert!(log.read(0, 10, 1000).unwrap().is_empty());
        log.flush().unwrap();
        assert_eq!(log.len(), 2);
        assert_eq!(all_events(&log).len(), 2);
        // A status flushes what is staged first, so it follows its events in the file.
        log.stage_event(&delta(2, "c")).unwrap();
        log.append_status(&json!({"state": "done"})).unwrap();
        let text = fs::read_to_string(log.path()).unwrap();
        let last: Vec<&str> = text.lines().rev().take(2).collect();
        assert!(
            last[0].starts_with(r#"{"kind":"status","cursor":3,"#),
            "{text}"
        );
        assert!(
            last[1].starts_with(r#"{"kind":"event","cursor":2,"#),
            "{text}"
        );
        // Reads from the file (past the tail) and from memory agree on staged-then-written
        // events, across index strides.
        let mut other = store.create(header("q")).unwrap();
        for i in 0..(2 * STAGE_EVENTS + 3) {
            other.stage_event(&delta(i, "x")).unwrap();
            // The cap writes on its own: never more than `STAGE_EVENTS` wait.
            assert!(other.len() as usize + STAGE_EVENTS > i);
        }
        other.flush().unwrap();
        let from_memory = all_events(&other);
        other.release_tail();
        assert_eq!(all_events(&other), from_memory);
        assert_eq!(from_memory.len(), 2 * STAGE_EVENTS + 3);
        // A write that fails drops what was staged and leaves the log as it was.
        let Ok(full) = OpenOptions::new().read(true).append(true).open("/dev/full") else {
            return;
        };
        let shown = other.len();
        other.access = Access::Append(full);
        other.stage_event(&delta(0, "lost")).unwrap();
        assert!(other.flush().is_err());
        assert_eq!(other.len(), shown);
        assert!(!other.has_staged());
    }

    #[test]
    fn a_record_goes_out_with_the_staged_events_in_one_write() {
        let tmp = TempDir::new("record-after-staged");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        log.stage_event(&delta(0, "a")).unwrap();
        log.stage_event(&delta(1, "b")).unwrap();
        let before = log.end;
        log.append_status(&json!({"state": "done"})).unwrap();
        assert!(!log.has_staged());
        assert_eq!(log.len(), 2);
        // The status stands after both events, in the file as in memory.
        assert_eq!(log.status_at(2), Some(&json!({"state": "done"})));
        let written = fs::read_to_string(&log.path).unwrap();
        let lines: Vec<&str> = written[before as usize..].lines().collect();
        assert_eq!(lines.len(), 3, "{written}");
        assert!(
            lines[2].starts_with(r#"{"kind":"status","cursor":2,"#),
            "{}",
            lines[2]
        );
        let loaded = store.load(&log.run_id).unwrap();
        assert_eq!(all_events(&loaded), all_events(&log));
        assert_eq!(loaded.last_status(), Some(&json!({"state": "done"})));
        // A write that fails takes neither: the events stay unshown, the status unrecorded.
        let Ok(full) = OpenOptions::new().read(true).append(true).open("/dev/full") else {
            return;
        };
        log.access = Access::Append(full);
        log.stage_event(&delta(2, "lost")).unwrap();
        assert!(log.append_status(&json!({"state": "failed"})).is_err());
        assert_eq!(log.len(), 2);
        assert_eq!(log.last_status(), Some(&json!({"state": "done"})));
    }

    /// Parks `store`'s syncer thread until the returned sender is dropped, so syncs handed
    /// to it stay pending.
    fn park_syncer(store: &SessionStore) -> std::sync::mpsc::Sender<()> {
        let (started, started_rx) = std::sync::mpsc::channel();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        store
            .syncer
            .0
            .submit(move || {
                let _ = started.send(());
                let _ = gate.recv();
            })
            .unwrap();
        started_rx.recv().unwrap();
        release
    }

    #[test]
    fn closing_through_the_store_lets_go_at_once_and_syncs_later() {
        let tmp = TempDir::new("close-later");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        log.append_event(&delta(0, "x")).unwrap();
        log.append_status(&json!({"state": "done"})).unwrap();
        let release = park_syncer(&store);
        store.close(&mut log);
        // The sync is still pending, yet the lock is free: another log of the run can
        // append. The tail serves until it is let go, then the file does.
        assert!(matches!(log.access, Access::Detached));
        assert_eq!(log.tail.events.len(), 1);
        log.release_tail();
        assert_eq!(all_events(&log), vec![delta(0, "x").to_string()]);
        assert!(!store.wait_for_syncs(Instant::now()));
        let mut other = store.load("run-1").unwrap();
        other.append_status(&json!({"state": "failed"})).unwrap();
        drop(release);
        assert!(store.wait_for_syncs(Instant::now() + Duration::from_secs(10)));
        store.close(&mut other);
        assert_eq!(store.load("run-1").unwrap().len(), 1);
    }

    #[test]
    fn the_sync_queue_holds_every_working_run_finishing_at_once() {
        let tmp = TempDir::new("sync-queue");
        let mut store = tmp.store("sessions");
        let queued = |store: &SessionStore, n: usize| {
            (0..n)
                .filter(|_| store.syncer.0.submit(|| {}).is_ok())
                .count()
        };
        let release = park_syncer(&store);
        assert_eq!(queued(&store, SYNC_QUEUE_CAP + 1), SYNC_QUEUE_CAP);
        drop(release);
        assert!(store.wait_for_syncs(Instant::now() + Duration::from_secs(10)));
        // A table that lets 1,000 runs work: 1,000 of them ending together all queue, so
        // none syncs on the loop.
        store.expect_working_runs(1000);
        let release = park_syncer(&store);
        assert_eq!(queued(&store, 1000), 1000);
        drop(release);
        assert!(store.wait_for_syncs(Instant::now() + Duration::from_secs(10)));
    }

    #[test]
    fn dropping_the_store_finishes_pending_syncs() {
        let tmp = TempDir::new("drop-syncs");
        let mut store = tmp.store("sessions");
        let mut log = store.create(header("p")).unwrap();
        let release = park_syncer(&store);
        store.close(&mut log);
        let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&synced);
        store
            .syncer
            .0
            .submit(move || flag.store(true, Ordering::SeqCst))
            .unwrap();
        let unpark = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            drop(release);
        });
        drop(store);
        assert!(synced.load(Ordering::SeqCst), "the drop returned first");
        unpark.join().unwrap();
    }

    #[test]
    fn a_syncer_that_takes_nothing_means_syncing_in_place() {
        let tmp = TempDir::new("sync-in-place");
        let mut store = tmp.store("sessions");
        store.syncer = Syncer(Pool::new("test-sync", 1, 0));
        let mut log = store.create(header("p")).unwrap();
        log.append_event(&delta(0, "x")).unwrap();
        store.close(&mut log);
        assert!(matches!(log.access, Access::Detached));
        assert!(log.dir_synced);
        assert!(store.wait_for_syncs(Instant::now()));
        assert_eq!(all_events(&log), vec![delta(0, "x").to_string()]);
    }

    #[test]
    fn default_dir_follows_xdg() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let both = env(&[("XDG_STATE_HOME", "/state"), ("HOME", "/home/u")]);
        assert_eq!(
            default_dir(&both).unwrap(),
            Path::new("/state/caliban/sessions")
        );
        let relative = env(&[("XDG_STATE_HOME", "state"), ("HOME", "/home/u")]);
        assert_eq!(
            default_dir(&relative).unwrap(),
            Path::new("/home/u/.local/state/caliban/sessions")
        );
        let empty = env(&[("XDG_STATE_HOME", ""), ("HOME", "")]);
        assert!(default_dir(&empty).is_err());
    }
}
