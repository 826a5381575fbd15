//! Model connections are kept alive between requests: the turns of a run share one
//! connection, and a server that closed an idle connection costs nothing the client can see
//! (no retry, no error). The stub numbers the connection each request came on. (The TLS and
//! proxy cases are in `tls.rs`, next to their relay and proxy.)

use serde_json::{Value, json};

use crate::util::*;

fn read(id: &str, path: &str) -> Turn {
    Turn::bare().calling([Call::read(id, path)])
}

/// The connection number of every model request the stub saw, in order.
fn connections(stub: &Stub) -> Vec<u64> {
    stub.requests()
        .iter()
        .map(|r| r["connection"].as_u64().expect("connection number"))
        .collect()
}

/// Runs `-p` in stream-json with no retries allowed, so any failure the client could see
/// fails the run; returns the output after checking it succeeded without a retry frame.
fn run_quietly(ws: &Workspace, stub: &Stub) -> Output {
    let out = run_stub(
        ws,
        stub,
        &[
            "-p",
            "--output-format",
            "stream-json",
            "--max-retries",
            "0",
            "read the files",
        ],
        "",
    );
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(out.result()["result"], "done", "{out:?}");
    let retries: Vec<Value> = out
        .frames()
        .into_iter()
        .filter(|f| f["subtype"] == "api_retry")
        .collect();
    assert!(retries.is_empty(), "a retry was shown: {retries:?}");
    out
}

#[test]
fn the_turns_of_a_run_share_one_model_connection() {
    let ws = Workspace::new("keepalive-turns");
    ws.write("a.txt", "alpha\n");
    ws.write("b.txt", "beta\n");
    let stub = Stub::start(
        &ws,
        &script([
            read("t1", "a.txt"),
            read("t2", "b.txt"),
            Turn::bare().say("done"),
        ]),
    );
    run_quietly(&ws, &stub);
    assert_eq!(connections(&stub), [1, 1, 1]);
}

#[test]
fn a_server_that_closes_after_each_response_costs_no_retry() {
    let ws = Workspace::new("keepalive-close-after");
    ws.write("a.txt", "alpha\n");
    ws.write("b.txt", "beta\n");
    // Every response says keep-alive, then the server closes: the next turn finds the
    // idle connection dead (or its request fails before any byte) and takes a fresh one.
    let first = read("t1", "a.txt").fault(Fault::CloseAfter);
    let second = read("t2", "b.txt").fault(Fault::CloseAfter);
    let stub = Stub::start(&ws, &script([first, second, Turn::bare().say("done")]));
    run_quietly(&ws, &stub);
    assert_eq!(connections(&stub), [1, 2, 3]);
}

#[test]
fn a_request_on_a_connection_the_server_just_closed_is_sent_again_unseen() {
    let ws = Workspace::new("keepalive-hang-up");
    ws.write("a.txt", "alpha\n");
    // The second request goes on the first turn's connection, and the server hangs up on
    // it without a byte (an idle timeout racing the request): the client sends it again on
    // a new connection, without a retry of the run's policy (there are none to spend).
    let stub = Stub::start(
        &ws,
        &script([
            read("t1", "a.txt"),
            Turn::bare().say("done").fault(Fault::HangUp),
        ]),
    );
    run_quietly(&ws, &stub);
    assert_eq!(connections(&stub), [1, 1, 2]);
}

/// `http serve`: the next run takes the connection the last one left; a run cancelled in the
/// middle of its model stream closes its connection, and the next run does not get it.
#[test]
fn runs_of_a_server_share_connections_but_not_a_cancelled_one() {
    use crate::util::http::{Serve, request};
    use crate::util::http::{start_run, wait_for, wait_terminal};

    let ws = Workspace::new("keepalive-serve");
    let stub = Stub::start(
        &ws,
        &script([
            Turn::bare().say("first"),
            Turn::bare().say("second"),
            // Two events, then the stream goes quiet with the connection open.
            Turn::bare()
                .say("never finished")
                .fault(Fault::StallAfterEvents(2)),
            Turn::bare().say("after the cancel"),
        ]),
    );
    let server = Serve::start(&ws, &stub, &[], &[]);
    let addr = server.addr;
    for n in 1..=2 {
        let run = start_run(addr, json!({"prompt": format!("run {n}")}));
        assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    }
    assert_eq!(connections(&stub), [1, 1]);
    let stalled = start_run(addr, json!({"prompt": "run 3"}));
    wait_for("the third request to reach the model", || {
        (stub.requests().len() == 3).then_some(())
    });
    let cancel = request(addr, "POST", &format!("/runs/{stalled}/cancel"), &[], b"");
    assert_eq!(cancel.status, 200, "{cancel:?}");
    assert_eq!(wait_terminal(addr, &stalled), json!({"state": "done"}));
    let run = start_run(addr, json!({"prompt": "run 4"}));
    assert_eq!(wait_terminal(addr, &run), json!({"state": "done"}));
    // (The stub numbers this test's own `/_stub/requests` connections too.)
    let conns = connections(&stub);
    assert_eq!(conns.len(), 4, "{conns:?}");
    assert!(conns[..3].iter().all(|c| *c == conns[0]), "{conns:?}");
    assert_ne!(
        conns[3], conns[2],
        "the cancelled run's connection was reused"
    );
}

/// Idle model connections keep to a quarter of the server's open-file limit, which the runs'
/// session files, model connections and clients need first: under a limit of 200, the 60
/// connections of runs that streamed at once leave at most 50 idle, so the next 60 runs open
/// at least 10 new ones (with no cap all 60 would be reused).
#[test]
fn idle_connections_keep_to_a_quarter_of_the_open_file_limit() {
    use crate::util::http::{Serve, serve_command};
    use crate::util::http::{start_run, wait_terminal};
    use std::collections::HashSet;

    const RUNS: usize = 60;
    let ws = Workspace::new("keepalive-fd-cap");
    // Every request of both rounds waits before its answer (a fault serves one request), so
    // a round's requests are all open at once.
    let slow = (0..2 * RUNS).fold(Turn::bare().say("slow").reuse(), |turn, _| {
        turn.fault(Fault::DelayMs(600))
    });
    let stub = Stub::start(&ws, &script([slow]));
    let cmd = serve_command(&ws, &stub, &[], &[]);
    // The limit is set by a shell that then becomes the server (the tests use no unsafe
    // `pre_exec`); hard and soft, so the server cannot raise it.
    let mut limited = std::process::Command::new("sh");
    limited
        .arg("-c")
        .arg(r#"ulimit -n 200 && exec "$0" "$@""#)
        .arg(cmd.get_program())
        .args(cmd.get_args());
    for (key, value) in cmd.get_envs() {
        match value {
            Some(value) => limited.env(key, value),
            None => limited.env_remove(key),
        };
    }
    if let Some(dir) = cmd.get_current_dir() {
        limited.current_dir(dir);
    }
    let server = Serve::spawn(limited);
    let addr = server.addr;
    let round = || {
        let runs: Vec<String> = (0..RUNS)
            .map(|i| start_run(addr, json!({"prompt": format!("run {i}")})))
            .collect();
        for run in &runs {
            assert_eq!(wait_terminal(addr, run), json!({"state": "done"}));
        }
    };
    round();
    let first: HashSet<u64> = connections(&stub).into_iter().collect();
    assert_eq!(
        first.len(),
        RUNS,
        "the first round's requests were all open at once"
    );
    round();
    let second = connections(&stub);
    let fresh: HashSet<&u64> = second[RUNS..]
        .iter()
        .filter(|c| !first.contains(c))
        .collect();
    assert!(
        fresh.len() >= RUNS - 50,
        "{} of the second round's connections were new: more than 50 were kept idle",
        fresh.len()
    );
}
