//! What tests put in front of caliban besides a script: files for a workspace, images for a
//! prompt, a web site to fetch.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::Duration;

use serde_json::{Value, json};

use super::Workspace;

/// A 12 KiB file whose lines all carry `marker`: one Read of it is ~3,400 tokens.
pub fn big_file(ws: &Workspace, name: &str, marker: &str) {
    let line = format!("{marker} lorem ipsum dolor sit amet, consectetur\n");
    ws.write(name, &line.repeat(12 * 1024 / line.len()));
}

/// A 1×1 PNG, base64.
pub const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

/// An image block in upstream's shape.
pub fn image_block(media_type: &str, data: &str) -> Value {
    json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}})
}

/// A loopback web server for WebFetch, on a thread of the test: `/page` (HTML), `/moved`
/// (a same-site redirect to `/page`), `/away` (a redirect to another site), `/missing`
/// (404), `/slow` (never answers). Nothing reaches beyond loopback.
pub fn web_server() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            std::thread::spawn(move || {
                conn.set_read_timeout(Some(Duration::from_secs(10))).ok();
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
                    match conn.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let head = String::from_utf8_lossy(&head);
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let (status, extra, body): (&str, String, String) = match path.as_str() {
                    "/page" => (
                        "200 OK",
                        "content-type: text/html; charset=utf-8\r\n".into(),
                        "<html><head><title>Fixture</title><script>var x = '<p>no';</script>\
                         </head><body><h1>Release notes</h1><p>Version <b>4.2</b> &amp; more.\
                         </p><a href=\"/docs\">docs</a></body></html>"
                            .into(),
                    ),
                    "/moved" => ("302 Found", "location: /page\r\n".into(), String::new()),
                    "/away" => (
                        "301 Moved Permanently",
                        "location: http://elsewhere.invalid/x\r\n".into(),
                        String::new(),
                    ),
                    "/slow" => {
                        std::thread::sleep(Duration::from_secs(10));
                        return;
                    }
                    _ => (
                        "404 Not Found",
                        "content-type: text/plain\r\n".into(),
                        "no such page".into(),
                    ),
                };
                let _ = write!(
                    conn,
                    "HTTP/1.1 {status}\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
            });
        }
    });
    format!("http://{addr}")
}
