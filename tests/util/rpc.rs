//! One line-delimited JSON-RPC 2.0 peer, for the surfaces that speak it: `caliban acp serve`
//! and `caliban mcp serve` on a child's stdio, and ACP on the socket of `caliban agent
//! serve`. A reader thread turns the incoming stream into lines (and a child's stderr into a
//! log), so every receive has a deadline and a failure shows what caliban said. The peer is
//! the client: it sends requests, waits for the response with a given id and keeps what came
//! in between (notifications, server→client requests) in `seen`, or answers the server's
//! requests through a callback.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{StderrLog, wait_for_exit};

/// A JSON-RPC connection: to a spawned server on piped stdio (SIGKILLed on drop), or over a
/// stream.
pub struct Peer {
    child: Option<Child>,
    writer: Option<Box<dyn Write + Send>>,
    lines: Receiver<String>,
    stderr: StderrLog,
    /// How long any single receive waits.
    timeout: Duration,
    /// Notifications and server requests seen while waiting for responses.
    pub seen: Vec<Value>,
}

impl Peer {
    /// Spawns `cmd` (arguments and environment already set) with piped stdio; every
    /// receive waits at most `timeout`.
    pub fn spawn(mut cmd: Command, timeout: Duration) -> Peer {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn caliban");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take().expect("stdin");
        let stderr = StderrLog::start(child.stderr.take().expect("stderr"), None);
        let mut peer = Peer::over(stdout, stdin, timeout);
        peer.child = Some(child);
        peer.stderr = stderr;
        peer
    }

    /// A peer on a connected Unix socket.
    pub fn unix(path: &Path, timeout: Duration) -> Peer {
        let stream = std::os::unix::net::UnixStream::connect(path).expect("connect unix");
        let reader = stream.try_clone().expect("clone the socket");
        Peer::over(reader, stream, timeout)
    }

    /// A peer reading lines from `reader` and writing to `writer`.
    pub fn over(
        reader: impl Read + Send + 'static,
        writer: impl Write + Send + 'static,
        timeout: Duration,
    ) -> Peer {
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Peer {
            child: None,
            writer: Some(Box::new(writer)),
            lines,
            stderr: StderrLog::default(),
            timeout,
            seen: Vec::new(),
        }
    }

    /// The spawned server.
    pub fn child(&mut self) -> &mut Child {
        self.child.as_mut().expect("a peer of a spawned server")
    }

    /// Everything the child wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Writes one line (a newline is added), as is: for malformed input too.
    pub fn send_line(&mut self, line: &str) {
        let writer = self.writer.as_mut().expect("stdin open");
        writer
            .write_all(format!("{line}\n").as_bytes())
            .expect("write stdin");
        writer.flush().expect("flush stdin");
    }

    pub fn send(&mut self, message: Value) {
        self.send_line(&message.to_string());
    }

    /// The next line on stdout, or None when none came within `timeout`.
    pub fn recv_line_within(&mut self, timeout: Duration) -> Option<String> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// The next line on stdout as it was written.
    pub fn recv_line(&mut self) -> String {
        let timeout = self.timeout;
        self.recv_line_within(timeout)
            .unwrap_or_else(|| panic!("no line within {timeout:?}; stderr:\n{}", self.stderr()))
    }

    /// The next line on stdout, which must be one JSON-RPC 2.0 message; None on timeout.
    pub fn recv_within(&mut self, timeout: Duration) -> Option<Value> {
        let line = self.recv_line_within(timeout)?;
        let value: Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("stdout carried a non-JSON line ({e}): {line:?}"));
        assert_eq!(value["jsonrpc"], "2.0", "{value}");
        Some(value)
    }

    pub fn recv(&mut self) -> Value {
        let timeout = self.timeout;
        self.recv_within(timeout)
            .unwrap_or_else(|| panic!("no message within {timeout:?}; stderr:\n{}", self.stderr()))
    }

    /// Messages until one matches: it, and those before it.
    pub fn recv_until(&mut self, what: impl Fn(&Value) -> bool) -> (Value, Vec<Value>) {
        let mut before = Vec::new();
        loop {
            let message = self.recv();
            if what(&message) {
                return (message, before);
            }
            before.push(message);
        }
    }

    pub fn send_request(&mut self, id: u64, method: &str, params: Value) {
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
    }

    /// Sends a request and returns its response, keeping anything else in `seen`.
    pub fn request(&mut self, id: u64, method: &str, params: Value) -> Value {
        self.send_request(id, method, params);
        self.response(id)
    }

    /// Waits for the response to request `id`, keeping anything else in `seen`.
    pub fn response(&mut self, id: u64) -> Value {
        self.response_answering(id, |_| None)
    }

    /// Waits for the response to request `id`. A server→client request for which `answer`
    /// gives a result is answered with it; everything else is kept in `seen`.
    pub fn response_answering(
        &mut self,
        id: u64,
        mut answer: impl FnMut(&Value) -> Option<Value>,
    ) -> Value {
        loop {
            let message = self.recv();
            if message["id"] == id && message.get("method").is_none() {
                return message;
            }
            if message.get("method").is_some()
                && message.get("id").is_some()
                && let Some(result) = answer(&message)
            {
                self.send(json!({"jsonrpc": "2.0", "id": message["id"], "result": result}));
                continue;
            }
            self.seen.push(message);
        }
    }

    /// The MCP handshake: `initialize` (id 0) with `capabilities`, then `initialized`.
    pub fn mcp_initialize(&mut self, version: &str, capabilities: Value, client: &str) -> Value {
        let reply = self.request(
            0,
            "initialize",
            json!({"protocolVersion": version, "capabilities": capabilities,
                   "clientInfo": {"name": client, "version": "0"}}),
        );
        self.send(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        reply
    }

    /// `tools/call` on an MCP server: the result.
    pub fn tool(&mut self, id: u64, name: &str, arguments: Value) -> Value {
        let reply = self.request(
            id,
            "tools/call",
            json!({"name": name, "arguments": arguments}),
        );
        reply["result"].clone()
    }

    /// `tools/call` on an MCP server that must succeed: the JSON body of its text block.
    pub fn tool_body(&mut self, id: u64, name: &str, arguments: Value) -> Value {
        let result = self.tool(id, name, arguments);
        assert_eq!(result["isError"], false, "{result}");
        serde_json::from_str(result["content"][0]["text"].as_str().expect("text")).expect("json")
    }

    /// Closes stdin (EOF for the server).
    pub fn close_stdin(&mut self) {
        self.writer = None;
    }

    /// Waits for the process to exit; its exit code.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let status = wait_for_exit(self.child(), timeout);
        status
            .unwrap_or_else(|| {
                panic!(
                    "caliban did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr()
                )
            })
            .code()
    }

    /// Closes stdin and waits (at most 10 s) for the exit: its code, and how long it took.
    pub fn close(&mut self) -> (Option<i32>, Duration) {
        let start = Instant::now();
        self.close_stdin();
        let code = self.wait_exit(Duration::from_secs(10));
        (code, start.elapsed())
    }

    /// The address of the `<what> listening on <scheme>://host:port/…` line on stderr.
    pub fn listen_addr(&self, what: &str) -> SocketAddr {
        let deadline = Instant::now() + self.timeout;
        let marker = format!("{what} listening on ");
        loop {
            let log = self.stderr();
            if let Some(rest) = log.split(&marker).nth(1) {
                let rest = rest.split_once("://").expect("a URL").1;
                let hostport = rest.split('/').next().expect("host:port");
                return hostport.parse().expect("socket address");
            }
            assert!(
                Instant::now() < deadline,
                "no listening line; stderr:\n{log}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
