//! The `WebFetch` tool: an HTTP(S) GET of one URL over caliban's own client
//! (`http::client::Exchange`, driven by the engine on the reactor like a model request), with
//! a size cap, a deadline and HTML reduced to text. This file holds the pure parts: the spec,
//! checking a call's input into a `FetchRequest`, the request bytes, where a redirect may be
//! followed, and the result the model reads; the engine does the I/O.
//!
//! Redirects are followed within the same scheme, host and port only (at most
//! `MAX_REDIRECTS`): a redirect elsewhere is handed back to the model as a new URL to fetch,
//! so the permission rules judge it like any other (an allowed `WebFetch(domain:docs.rs)` must
//! not become a fetch of another site).

use std::borrow::Cow;
use std::time::Duration;

use serde_json::{Value, json};

use crate::http::client;
use crate::http::target::Target;
use crate::http::write;
use crate::model::types::ToolSpec;
use crate::tools::{ToolOutput, cap_title, closed_object, text_field, timeout_seconds};

/// The most of a response body read (upstream's 10 MB); past it the fetch stops and the
/// text is marked cut.
pub const MAX_FETCH_BODY: usize = 10 * 1024 * 1024;
/// The most text handed to the model from one page.
pub const MAX_FETCH_TEXT: usize = 100 * 1024;
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
pub const MAX_TIMEOUT_SECS: u64 = 300;
/// Same-site redirects followed before giving up.
pub const MAX_REDIRECTS: u8 = 5;
/// The longest URL accepted; longer ones are not pages a model should be fetching.
const MAX_URL_BYTES: usize = 8 * 1024;

/// A `WebFetch` call, checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchRequest {
    /// The URL as fetched (without a fragment).
    pub url: String,
    pub target: Target,
    /// The request target: path and query, `/` at least.
    pub path: String,
    pub timeout: Duration,
    /// What the model wants from the page, echoed with the text.
    pub prompt: Option<String>,
    /// Same-site redirects followed so far.
    pub redirects: u8,
}

/// `WebFetch` as offered to the model.
pub(crate) fn spec() -> ToolSpec {
    ToolSpec {
        name: Cow::Borrowed("WebFetch"),
        description: Cow::Borrowed(
            "Fetch a web page or file with an HTTP(S) GET and return its text: HTML is \
            reduced to readable text (scripts and styles dropped, links kept as [text](url)), \
            text and JSON come as they are, other content types are described, not shown. At \
            most 10 MB is read and 100 KiB of text returned. Redirects within the same site \
            are followed; a redirect to another site is reported for you to fetch. The URL is \
            checked against the permission rules.",
        ),
        input_schema: closed_object(
            json!({
                "url": {
                    "type": "string",
                    "description": "The http:// or https:// URL to fetch."
                },
                "prompt": {
                    "type": "string",
                    "description": "What you want to learn from the page (shown with the text)."
                },
                "timeout_seconds": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 300,
                    "description": "Give up after this many seconds (1-300, default 60)."
                }
            }),
            &["url"],
        ),
    }
}

/// A call's title: the URL.
pub(crate) fn title(input: &Value) -> String {
    cap_title(text_field(input, "url"))
}

/// Checks a `WebFetch` call's input. Errors are tool results for the model.
pub(crate) fn parse_input(input: &Value) -> Result<FetchRequest, ToolOutput> {
    let url = match input.get("url") {
        Some(Value::String(url)) if !url.trim().is_empty() => url.trim(),
        _ => {
            return Err(ToolOutput::error(
                "WebFetch: missing required string field `url`",
            ));
        }
    };
    let timeout = timeout_seconds(input, "WebFetch", DEFAULT_TIMEOUT, MAX_TIMEOUT_SECS)?;
    let prompt = match input.get("prompt") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(p.clone()).filter(|p| !p.trim().is_empty()),
        Some(_) => return Err(ToolOutput::error("WebFetch: `prompt` must be a string")),
    };
    let (target, path, url) =
        parse_url(url).map_err(|e| ToolOutput::error(format!("WebFetch: {e}")))?;
    Ok(FetchRequest {
        url,
        target,
        path,
        timeout,
        prompt,
        redirects: 0,
    })
}

/// An `http(s)://` URL as a target, a request path (path and query) and the URL without its
/// fragment.
fn parse_url(url: &str) -> Result<(Target, String, String), String> {
    if url.len() > MAX_URL_BYTES {
        return Err(format!("the URL is longer than {MAX_URL_BYTES} bytes"));
    }
    if url.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err("the URL holds spaces or control characters; percent-encode them".into());
    }
    let url = url.split('#').next().unwrap_or(url);
    let scheme_end = url
        .find("://")
        .ok_or_else(|| format!("`{url}` is not an http:// or https:// URL"))?;
    let scheme = url[..scheme_end].to_ascii_lowercase();
    if scheme != "http" && scheme != "https" {
        return Err(format!(
            "`{url}`: only http:// and https:// URLs can be fetched"
        ));
    }
    let rest = &url[scheme_end + 3..];
    let split = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, path) = rest.split_at(split);
    if authority.contains('@') {
        return Err(format!(
            "`{url}`: URLs with a user name or password are not fetched"
        ));
    }
    let (mut target, _) = client::parse_base_url(&format!("{scheme}://{authority}"))?;
    // Host names compare case-insensitively; rules and redirects see one spelling.
    target.host.make_ascii_lowercase();
    let path = match path {
        "" => "/".to_owned(),
        p if p.starts_with('?') => format!("/{p}"),
        p => p.to_owned(),
    };
    Ok((
        target,
        path,
        format!("{scheme}://{authority}{}", &rest[split..]),
    ))
}

impl FetchRequest {
    /// The GET request's bytes.
    pub fn request_bytes(&self) -> Vec<u8> {
        let agent = format!("caliban/{} (WebFetch)", env!("CARGO_PKG_VERSION"));
        write::request(
            "GET",
            &self.path,
            &self.target.host_header(),
            &[
                ("user-agent", &agent),
                (
                    "accept",
                    "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5",
                ),
                ("accept-encoding", "identity"),
                ("connection", "close"),
            ],
            b"",
        )
    }

    /// Where a redirect to `location` leads: the next request when it stays on this site,
    /// else the result that tells the model the new URL.
    pub fn redirect(
        &self,
        status: u16,
        location: Option<&str>,
    ) -> Result<FetchRequest, ToolOutput> {
        let Some(location) = location.map(str::trim).filter(|l| !l.is_empty()) else {
            return Err(ToolOutput::error(format!(
                "WebFetch: {} answered {status} with no Location",
                self.url
            )));
        };
        let absolute = if location.contains("://") {
            location.to_owned()
        } else if let Some(rest) = location.strip_prefix("//") {
            let scheme = if self.target.tls { "https" } else { "http" };
            format!("{scheme}://{rest}")
        } else {
            let origin = self.origin();
            if location.starts_with('/') {
                format!("{origin}{location}")
            } else {
                // Relative to the current path's directory.
                let dir = self.path.split('?').next().unwrap_or("/");
                let dir = &dir[..dir.rfind('/').map_or(0, |i| i + 1)];
                format!("{origin}{dir}{location}")
            }
        };
        let next = parse_url(&absolute).map_err(|e| {
            ToolOutput::error(format!("WebFetch: bad redirect from {}: {e}", self.url))
        })?;
        if next.0 != self.target {
            return Err(ToolOutput::ok(format!(
                "{} redirects ({status}) to another site: {}\nFetch that URL with WebFetch to \
                 follow it.",
                self.url, next.2
            )));
        }
        if self.redirects >= MAX_REDIRECTS {
            return Err(ToolOutput::error(format!(
                "WebFetch: {} redirected more than {MAX_REDIRECTS} times",
                self.url
            )));
        }
        Ok(FetchRequest {
            url: next.2,
            target: next.0,
            path: next.1,
            redirects: self.redirects + 1,
            ..self.clone()
        })
    }

    fn origin(&self) -> String {
        let scheme = if self.target.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.target.host_header())
    }

    /// The result for a complete (or capped) response.
    pub fn render(&self, status: u16, content_type: &str, body: &[u8], cut: bool) -> ToolOutput {
        let kind = content_type
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let mut head = format!(
            "→ WebFetch {} ({status}, {}, {} bytes{})\n",
            self.url,
            if kind.is_empty() {
                "no content type"
            } else {
                &kind
            },
            body.len(),
            if cut {
                format!(", cut at {} MB", MAX_FETCH_BODY / (1024 * 1024))
            } else {
                String::new()
            }
        );
        if let Some(prompt) = &self.prompt {
            head.push_str(&format!("Looking for: {prompt}\n"));
        }
        head.push('\n');
        let textual = kind.starts_with("text/")
            || kind.is_empty()
            || kind.ends_with("json")
            || kind.ends_with("xml")
            || kind.ends_with("+json")
            || kind == "application/javascript";
        let text = if kind == "text/html" || kind == "application/xhtml+xml" {
            html_to_text(&String::from_utf8_lossy(body))
        } else if textual {
            String::from_utf8_lossy(body).into_owned()
        } else {
            format!("[{kind} content, {} bytes: not shown as text]", body.len())
        };
        let mut out = head;
        match crate::text::cut_chars(&text, MAX_FETCH_TEXT) {
            Some((kept, _)) => {
                out.push_str(kept);
                out.push_str(&format!(
                    "\n[… text cut at {} KiB of {} characters]",
                    MAX_FETCH_TEXT / 1024,
                    text.chars().count()
                ));
            }
            None => out.push_str(&text),
        }
        ToolOutput::new(status >= 400, out)
    }
}

/// Elements whose content is not text a reader sees.
const SKIPPED: [&str; 6] = ["script", "style", "noscript", "template", "svg", "iframe"];
/// Elements that start a new line (or paragraph) of text.
const BLOCKS: [&str; 24] = [
    "p",
    "div",
    "br",
    "li",
    "ul",
    "ol",
    "tr",
    "table",
    "section",
    "article",
    "header",
    "footer",
    "nav",
    "main",
    "aside",
    "blockquote",
    "pre",
    "h1",
    "h2",
    "h3",
    "h4",
    "h5",
    "h6",
    "hr",
];

/// HTML reduced to readable text: tags dropped (scripts, styles and the head with their
/// content), block elements on lines of their own, headings marked `#`, list items `-`,
/// links as `[text](href)`, entities decoded and runs of blanks folded. `<title>` is kept as
/// the first line. Not a parser: malformed markup degrades to more or less text, never to an
/// error.
pub fn html_to_text(html: &str) -> String {
    let mut out = String::new();
    let mut title = String::new();
    let mut in_title = false;
    let mut in_pre = false;
    let mut href: Option<String> = None;
    let mut link_start = 0;
    let mut rest = html;
    while !rest.is_empty() {
        let Some(lt) = rest.find('<') else {
            push_text(&mut out, rest, in_pre, in_title, &mut title);
            break;
        };
        push_text(&mut out, &rest[..lt], in_pre, in_title, &mut title);
        rest = &rest[lt..];
        if let Some(comment) = rest.strip_prefix("<!--") {
            rest = comment.find("-->").map_or("", |end| &comment[end + 3..]);
            continue;
        }
        let Some(gt) = rest.find('>') else {
            break;
        };
        let tag = &rest[1..gt];
        rest = &rest[gt + 1..];
        let closing = tag.starts_with('/');
        let name: String = tag
            .trim_start_matches('/')
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase();
        if name == "title" {
            in_title = !closing;
            continue;
        }
        if SKIPPED.contains(&name.as_str()) && !closing && !tag.ends_with('/') {
            // Script text is not markup (`if (a<b)`): jump to the closing tag itself.
            rest = after_closing_tag(rest, &name);
            continue;
        }
        if name == "pre" {
            in_pre = !closing;
        }
        if name == "a" {
            if closing {
                if let Some(target) = href.take() {
                    let text = out[link_start..].trim().to_owned();
                    if !target.starts_with('#') && !target.starts_with("javascript:") {
                        out.truncate(link_start);
                        out.push_str(&format!("[{text}]({target})"));
                    }
                }
            } else {
                href = attribute(tag, "href").map(|h| decode_entities(&h).into_owned());
                link_start = out.len();
            }
            continue;
        }
        if BLOCKS.contains(&name.as_str()) {
            let blank = matches!(
                name.as_str(),
                "p" | "h1" | "h2" | "h3" | "h4" | "h5" | "h6" | "pre" | "table" | "blockquote"
            );
            newline(&mut out, blank);
            if !closing {
                match name.as_str() {
                    "li" => out.push_str("- "),
                    "hr" => out.push_str("---\n"),
                    h if h.len() == 2 && h.starts_with('h') && h != "hr" => {
                        let level = h[1..].parse().unwrap_or(1);
                        out.push_str(&"#".repeat(level));
                        out.push(' ');
                    }
                    _ => {}
                }
            }
        } else if matches!(name.as_str(), "td" | "th") && !closing && !out.ends_with('\n') {
            out.push_str(" | ");
        }
    }
    let body = out.trim();
    let title = title.split_whitespace().collect::<Vec<_>>().join(" ");
    if title.is_empty() {
        body.to_owned()
    } else {
        format!("# {title}\n\n{body}")
    }
}

/// Appends text outside tags: decoded, blanks folded (kept as they are inside `<pre>`).
fn push_text(out: &mut String, raw: &str, pre: bool, in_title: bool, title: &mut String) {
    if raw.is_empty() {
        return;
    }
    let text = decode_entities(raw);
    if in_title {
        title.push_str(&text);
        return;
    }
    if pre {
        out.push_str(&text);
        return;
    }
    let starts_blank = text.starts_with(char::is_whitespace);
    let ends_blank = text.ends_with(char::is_whitespace);
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.is_empty() {
        if !out.is_empty() && !out.ends_with([' ', '\n']) {
            out.push(' ');
        }
        return;
    }
    if starts_blank && !out.is_empty() && !out.ends_with([' ', '\n']) {
        out.push(' ');
    }
    out.push_str(&words.join(" "));
    if ends_blank {
        out.push(' ');
    }
}

/// What follows `</name…>` (matched case-insensitively), or nothing when it never comes.
fn after_closing_tag<'h>(html: &'h str, name: &str) -> &'h str {
    let mut from = 0;
    while let Some(at) = html[from..].find("</") {
        let start = from + at + 2;
        let candidate = html.get(start..start + name.len());
        if candidate.is_some_and(|c| c.eq_ignore_ascii_case(name)) {
            return html[start..]
                .find('>')
                .map_or("", |gt| &html[start + gt + 1..]);
        }
        from = start;
    }
    ""
}

/// Ends the current line (and leaves a blank line for `blank`), without piling up blanks.
fn newline(out: &mut String, blank: bool) {
    while out.ends_with(' ') {
        out.pop();
    }
    if out.is_empty() {
        return;
    }
    let want = if blank { "\n\n" } else { "\n" };
    while !out.ends_with(want) {
        out.push('\n');
    }
}

/// The value of attribute `name` in a tag's text (`a href="x" class=y`).
fn attribute(tag: &str, name: &str) -> Option<String> {
    let lower = tag.to_ascii_lowercase();
    let mut from = 0;
    while let Some(at) = lower[from..].find(name) {
        let start = from + at;
        from = start + name.len();
        let before_ok = start == 0 || lower.as_bytes()[start - 1].is_ascii_whitespace();
        let after = lower[from..].trim_start();
        if !before_ok || !after.starts_with('=') {
            continue;
        }
        let value_at = tag.len() - after.len() + 1;
        let value = tag[value_at..].trim_start();
        return Some(match value.chars().next() {
            Some(quote @ ('"' | '\'')) => value[1..].split(quote).next().unwrap_or("").to_owned(),
            _ => value
                .split(|c: char| c.is_whitespace() || c == '>')
                .next()
                .unwrap_or("")
                .to_owned(),
        });
    }
    None
}

/// Decodes the common named entities and every numeric one; anything else stays as written.
fn decode_entities(text: &str) -> Cow<'_, str> {
    if !text.contains('&') {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(amp) = rest.find('&') {
        out.push_str(&rest[..amp]);
        rest = &rest[amp..];
        let end = rest[1..].find(';').map(|i| i + 1).filter(|&i| i <= 12);
        let decoded = end.and_then(|end| {
            let entity = &rest[1..end];
            let ch = match entity {
                "amp" => Some('&'),
                "lt" => Some('<'),
                "gt" => Some('>'),
                "quot" => Some('"'),
                "apos" | "#39" => Some('\''),
                "nbsp" => Some(' '),
                "mdash" => Some('—'),
                "ndash" => Some('–'),
                "hellip" => Some('…'),
                "copy" => Some('©'),
                _ => entity.strip_prefix('#').and_then(|num| {
                    let code = match num.strip_prefix(['x', 'X']) {
                        Some(hex) => u32::from_str_radix(hex, 16).ok(),
                        None => num.parse().ok(),
                    };
                    code.and_then(char::from_u32)
                }),
            };
            ch.map(|ch| (ch, end))
        });
        match decoded {
            Some((ch, end)) => {
                out.push(ch);
                rest = &rest[end + 1..];
            }
            None => {
                out.push('&');
                rest = &rest[1..];
            }
        }
    }
    out.push_str(rest);
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn html_becomes_readable_text() {
        let html = r#"<!doctype html><html><head><title>The  Page</title>
            <style>body { color: red }</style><script>alert("x<y")</script></head>
            <body><!-- a comment <b> --><h1>Hello &amp; welcome</h1>
            <p>First   paragraph with a <a href="/docs?a=1&amp;b=2">link</a>.</p>
            <ul><li>one</li><li>two &#x2192; three</li></ul>
            <pre>  keep
    this</pre><p>caf&eacute; &#233;<br>next line</p></body></html>"#;
        let text = html_to_text(html);
        assert_eq!(
            text,
            "# The Page\n\n# Hello & welcome\n\nFirst paragraph with a [link](/docs?a=1&b=2).\n\n\
             - one\n- two → three\n\n  keep\n    this\n\ncaf&eacute; é\nnext line"
        );
        // Broken markup degrades, never fails.
        assert_eq!(html_to_text("a <b unclosed"), "a");
        assert_eq!(html_to_text("<script>never closed"), "");
        assert_eq!(
            html_to_text("x &amp y &#99999999; z"),
            "x &amp y &#99999999; z"
        );
    }

    #[test]
    fn urls_and_inputs() {
        let req = parse_input(&json!({"url": "http://127.0.0.1:8080?q=1#frag"})).unwrap();
        assert_eq!(req.path, "/?q=1");
        assert_eq!(req.url, "http://127.0.0.1:8080?q=1");
        assert_eq!(req.target.port, 8080);
        let text = String::from_utf8(req.request_bytes()).unwrap();
        assert!(
            text.starts_with("GET /?q=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"),
            "{text}"
        );
        let req = parse_input(&json!({"url": "HTTPS://Docs.rs/serde/"})).unwrap();
        assert!(req.target.tls);
        assert_eq!(req.path, "/serde/");
        for (input, want) in [
            (json!({}), "missing required string field `url`"),
            (json!({"url": "ftp://x/y"}), "only http:// and https://"),
            (
                json!({"url": "example.com"}),
                "not an http:// or https:// URL",
            ),
            (json!({"url": "http://u:p@x/"}), "user name or password"),
            (
                json!({"url": "http://x/a b"}),
                "spaces or control characters",
            ),
            (
                json!({"url": "http://x/", "timeout_seconds": 0}),
                "from 1 to 300",
            ),
        ] {
            let err = parse_input(&input).unwrap_err();
            assert!(
                err.is_error && err.text.contains(want),
                "{input}: {}",
                err.text
            );
        }
    }

    #[test]
    fn redirects_stay_on_the_site() {
        let req = parse_input(&json!({"url": "http://h:81/a/b?c"})).unwrap();
        let next = req.redirect(302, Some("d")).unwrap();
        assert_eq!((next.url.as_str(), next.redirects), ("http://h:81/a/d", 1));
        let next = req.redirect(301, Some("/x")).unwrap();
        assert_eq!(next.path, "/x");
        let away = req.redirect(301, Some("https://other.org/")).unwrap_err();
        assert!(!away.is_error);
        assert!(
            away.text.contains("to another site: https://other.org/"),
            "{}",
            away.text
        );
        let mut looping = req.clone();
        looping.redirects = MAX_REDIRECTS;
        assert!(looping.redirect(302, Some("/y")).unwrap_err().is_error);
        assert!(req.redirect(302, None).unwrap_err().is_error);
    }

    #[test]
    fn results_by_content_type() {
        let req = parse_input(&json!({"url": "http://h/x", "prompt": "the version"})).unwrap();
        let out = req.render(200, "text/html; charset=utf-8", b"<p>v1.2</p>", false);
        assert_eq!(
            out.text,
            "→ WebFetch http://h/x (200, text/html, 11 bytes)\nLooking for: the version\n\nv1.2"
        );
        let out = req.render(404, "application/json", b"{\"error\":1}", false);
        assert!(out.is_error && out.text.ends_with("{\"error\":1}"));
        let out = req.render(200, "image/png", &[0u8; 10], true);
        assert!(out.text.contains("cut at 10 MB"), "{}", out.text);
        assert!(
            out.text
                .ends_with("[image/png content, 10 bytes: not shown as text]")
        );
        let long = "y".repeat(MAX_FETCH_TEXT + 10);
        let out = req.render(200, "text/plain", long.as_bytes(), false);
        assert!(out.text.ends_with(&format!(
            "[… text cut at 100 KiB of {} characters]",
            MAX_FETCH_TEXT + 10
        )));
    }
}
