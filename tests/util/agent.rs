//! `caliban agent serve` for the tests that run it: a test CA made by openssl for its TLS
//! listener, and the agent process itself, killed on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::time::Duration;

use super::*;

/// The longest the start-up line may take to arrive.
const RECV: Duration = Duration::from_secs(20);

// ---- a test CA, made by openssl ---------------------------------------------------------------

pub struct Pki {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// A CA that signed nothing here.
    pub other_ca: PathBuf,
    /// A key that does not belong to `cert`.
    pub other_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = output_within(
        Command::new("openssl").args(args).current_dir(dir),
        "openssl is needed to make the test CA",
        Duration::from_secs(30),
    );
    assert_eq!(out.code, Some(0), "openssl {args:?}: {out:?}");
}

/// A CA, a server certificate for `localhost` and 127.0.0.1 signed by it, an unrelated CA
/// and a stray key, in `ws/pki`.
pub fn pki(ws: &Workspace) -> Pki {
    pki_for(ws, "DNS:localhost,IP:127.0.0.1")
}

/// The same, the server certificate's subjectAltName being `san` (openssl's syntax).
pub fn pki_for(ws: &Workspace, san: &str) -> Pki {
    let dir = ws.path("pki");
    std::fs::create_dir_all(&dir).expect("mkdir pki");
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let ca_ext = [
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ];
    for (name, cn) in [("ca", "agent test CA"), ("other-ca", "unrelated CA")] {
        let (key, cert, subj) = (
            format!("{name}-key.pem"),
            format!("{name}.pem"),
            format!("/CN={cn}"),
        );
        let mut args = vec!["req", "-x509"];
        args.extend(ec);
        args.extend(["-keyout", &key, "-out", &cert, "-days", "2", "-subj", &subj]);
        args.extend(ca_ext);
        openssl(&dir, &args);
    }
    let mut args = vec!["req", "-new"];
    args.extend(ec);
    args.extend([
        "-keyout",
        "key.pem",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    openssl(&dir, &args);
    std::fs::write(
        dir.join("server.ext"),
        format!(
            "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n\
             extendedKeyUsage=serverAuth\nsubjectAltName={san}\n"
        ),
    )
    .expect("write ext");
    openssl(
        &dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca-key.pem",
            "-CAcreateserial",
            "-out",
            "cert.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
    openssl(
        &dir,
        &[
            "genpkey",
            "-algorithm",
            "EC",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-out",
            "other-key.pem",
        ],
    );
    Pki {
        ca: dir.join("ca.pem"),
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
        other_ca: dir.join("other-ca.pem"),
        other_key: dir.join("other-key.pem"),
    }
}

// ---- the agent --------------------------------------------------------------------------------

pub struct Agent {
    pub child: Child,
    /// `tls://ADDR` or `unix:PATH`, from the start-up line.
    pub endpoint: String,
    stderr: StderrLog,
}

impl Agent {
    /// Starts `caliban agent serve` with `flags`, the stub as its model and `env`, and waits
    /// for its start-up line.
    pub fn start(ws: &Workspace, stub: &Stub, flags: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut cmd = caliban_stub(ws, stub, &["agent", "serve"]);
        cmd.args(flags).envs(env.iter().copied());
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn caliban agent serve");
        let (tx, rx) = channel();
        let stderr = StderrLog::start(
            child.stderr.take().expect("stderr"),
            Some(("listening on ", tx)),
        );
        let endpoint = match rx.recv_timeout(RECV) {
            Ok(endpoint) => endpoint,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("no start-up line within {RECV:?}:\n{}", stderr.text());
            }
        };
        Agent {
            child,
            endpoint,
            stderr,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.endpoint
            .strip_prefix("tls://")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("not a TLS endpoint: {}", self.endpoint))
    }

    pub fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Waits for the agent to exit on its own; its exit code.
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        wait_for_exit(&mut self.child, within)
            .unwrap_or_else(|| {
                panic!(
                    "the agent did not exit within {within:?}:\n{}",
                    self.stderr()
                )
            })
            .code()
    }

    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
