//! The stdio transport: the server is a child process in its own process group (started
//! through `reaper::spawn`, the crate's one way of starting a process), speaking
//! newline-delimited JSON-RPC on non-blocking pipes watched by the reactor. Its stderr is
//! ours, so its logs reach the user.

use std::io::{self, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use mio::unix::pipe;
use mio::{Interest, Registry, Token};

use super::client::{Client, Event};
use crate::{jsonrpc, reaper, sys};

/// Splits a byte stream into lines, each at most `jsonrpc::MAX_MESSAGE_BYTES`; a longer line
/// is dropped whole.
#[derive(Default)]
pub struct LineReader {
    buf: Vec<u8>,
    /// Skipping the rest of an oversized line.
    skipping: bool,
}

impl LineReader {
    pub fn push(&mut self, mut bytes: &[u8], mut each: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            match bytes.iter().position(|&b| b == b'\n') {
                Some(at) => {
                    if !self.skipping {
                        self.buf.extend_from_slice(&bytes[..at]);
                        each(&self.buf);
                    }
                    self.buf.clear();
                    self.skipping = false;
                    bytes = &bytes[at + 1..];
                }
                None => {
                    if !self.skipping {
                        self.buf.extend_from_slice(bytes);
                        if self.buf.len() > jsonrpc::MAX_MESSAGE_BYTES {
                            crate::log::warn("an MCP server wrote an oversized line; dropping it");
                            self.buf = Vec::new();
                            self.skipping = true;
                        }
                    }
                    bytes = &[];
                }
            }
        }
    }
}

/// A running stdio server: the child and its pipes.
pub struct StdioConn {
    child: Child,
    pgid: u32,
    stdin: Option<pipe::Sender>,
    stdout: Option<pipe::Receiver>,
    lines: LineReader,
    /// Bytes of the message being written, when the pipe filled mid-message.
    partial: Vec<u8>,
    reaped: bool,
    /// What the sandbox made for the server to hold read-only, for as long as it lives.
    _placeholders: crate::sandbox::Placeholders,
}

impl StdioConn {
    /// Starts the server in its own process group, in the sandbox MCP servers get
    /// (`sandbox::mcp_server`: off unless `sandbox.mcp_servers` says otherwise).
    pub fn spawn(
        command: &str,
        args: &[String],
        env: &[(String, String)],
        cwd: &Path,
    ) -> io::Result<StdioConn> {
        let mut cmd = Command::new(command);
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let (confinement, placeholders) = match crate::sandbox::mcp_server(cwd)? {
            Some(confined) => (Some(confined.confinement), confined.placeholders),
            None => (None, crate::sandbox::Placeholders::default()),
        };
        let mut child = reaper::spawn(&mut cmd, None, confinement)?;
        let pgid = child.id();
        let pipes = (|| -> io::Result<(pipe::Sender, pipe::Receiver)> {
            let stdin = pipe::Sender::from(child.stdin.take().ok_or(io::ErrorKind::BrokenPipe)?);
            let stdout =
                pipe::Receiver::from(child.stdout.take().ok_or(io::ErrorKind::BrokenPipe)?);
            stdin.set_nonblocking(true)?;
            stdout.set_nonblocking(true)?;
            Ok((stdin, stdout))
        })();
        let (stdin, stdout) = match pipes {
            Ok(p) => p,
            Err(e) => {
                let _ = sys::kill_group(pgid, sys::SIGKILL);
                let _ = child.kill();
                let _ = reaper::wait(&mut child);
                return Err(e);
            }
        };
        Ok(StdioConn {
            child,
            pgid,
            stdin: Some(stdin),
            stdout: Some(stdout),
            lines: LineReader::default(),
            partial: Vec::new(),
            reaped: false,
            _placeholders: placeholders,
        })
    }

    pub fn pid(&self) -> u32 {
        self.pgid
    }

    /// Registers the pipes: `out` for stdout, `inp` for stdin.
    pub fn register(&mut self, registry: &Registry, out: Token, inp: Token) -> io::Result<()> {
        if let Some(p) = self.stdout.as_mut() {
            registry.register(p, out, Interest::READABLE)?;
        }
        if let Some(p) = self.stdin.as_mut() {
            registry.register(p, inp, Interest::WRITABLE)?;
        }
        Ok(())
    }

    /// Writes what the client queued until the pipe is full. A broken pipe fails the server.
    pub fn flush(&mut self, client: &mut Client, registry: &Registry) -> Vec<Event> {
        let Some(pipe) = self.stdin.as_mut() else {
            while client.take_outgoing().is_some() {}
            return Vec::new();
        };
        loop {
            if self.partial.is_empty() {
                match client.take_outgoing() {
                    Some(mut message) => {
                        message.push(b'\n');
                        self.partial = message;
                    }
                    None => return Vec::new(),
                }
            }
            match pipe.write(&self.partial) {
                Ok(0) => break,
                Ok(n) => {
                    self.partial.drain(..n);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Vec::new(),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        self.close(registry);
        client.fail("stopped reading its input")
    }

    /// Reads stdout until it would block; at EOF the server is taken as gone.
    pub fn read(&mut self, client: &mut Client, registry: &Registry) -> Vec<Event> {
        let mut events = Vec::new();
        let Some(pipe) = self.stdout.as_mut() else {
            return events;
        };
        let mut buf = [0u8; 16 * 1024];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    self.lines
                        .push(&buf[..n], |line| events.extend(client.on_bytes(line)));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Answers to the server's requests, and requests that followed a response.
                    events.extend(self.flush(client, registry));
                    return events;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        self.close(registry);
        events.extend(client.fail("exited"));
        events
    }

    fn close(&mut self, registry: &Registry) {
        if let Some(mut p) = self.stdout.take() {
            let _ = registry.deregister(&mut p);
        }
        if let Some(mut p) = self.stdin.take() {
            let _ = registry.deregister(&mut p);
        }
    }

    /// Closes the pipes, kills the process group and reaps the child (SIGKILL makes the
    /// wait short).
    pub fn kill(&mut self, registry: &Registry) {
        self.close(registry);
        self.terminate();
    }

    fn terminate(&mut self) {
        if self.reaped {
            return;
        }
        // The group is killed while the leader is still unreaped, so its id is not reused.
        let _ = sys::kill_group(self.pgid, sys::SIGKILL);
        let _ = self.child.kill();
        let _ = reaper::wait(&mut self.child);
        self.reaped = true;
    }
}

impl Drop for StdioConn {
    /// However a server is dropped, its process group does not outlive it.
    fn drop(&mut self) {
        self.terminate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_reader_drops_oversized_lines() {
        let mut r = LineReader::default();
        let mut got = Vec::new();
        r.push(b"ab", |l| got.push(l.to_vec()));
        r.push(b"c\nde\n", |l| got.push(l.to_vec()));
        assert_eq!(got, [b"abc".to_vec(), b"de".to_vec()]);
        got.clear();
        r.push(&vec![b'x'; jsonrpc::MAX_MESSAGE_BYTES + 1], |l| {
            got.push(l.to_vec())
        });
        r.push(b"xx\nok\n", |l| got.push(l.to_vec()));
        assert_eq!(got, [b"ok".to_vec()]);
    }
}
