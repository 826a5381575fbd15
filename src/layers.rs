//! The layering test. ARCHITECTURE.md's "Layers" table is the one list of layers, top row
//! highest; this reads it, then every file under `src/`, and fails on a reference to a
//! module that is not strictly below the referring one's (a row's modules are peers, and
//! peers do not use each other either, so the list admits no cycle). One crate gets no
//! such check from the compiler, and a map nobody checks stops being true.
//!
//! It reads paths, not names: `use crate::…` trees, `crate::…` and `super::…` in code, and
//! `use child::…` of a module's own children. Comments and string literals are skipped, so
//! a doc comment that names a module is not a use of it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Climbing references let through while a change that removes them is under way: (the
/// referring file, the unit it reaches, whose change removes it). Empty since issue 22; an
/// entry that no longer matches any reference fails the test, so none outlives its fix.
const PENDING: &[(&str, &str, &str)] = &[];
/// Modules that are not part of the product and so not on the map.
const OFF_THE_MAP: &[&str] = &[
    // This test.
    "layers",
];

/// One row of the table: the modules (units) it names, as paths without `crate::`.
type Row = Vec<Vec<String>>;

/// The rows of the "Layers" section's table, top first: each row's first cell holds its
/// modules in backticks (`surface::acp`, or a folder's `tools/`).
fn parse_layers(architecture: &str) -> Vec<Row> {
    let section = architecture
        .split("\n## ")
        .find(|s| s.starts_with("Layers\n"))
        .expect("ARCHITECTURE.md has a `## Layers` section");
    let mut rows = Vec::new();
    for line in section.lines() {
        let Some(cells) = line.strip_prefix('|') else {
            continue;
        };
        let first = cells.split('|').next().unwrap_or_default();
        if first.trim().starts_with("---") {
            continue;
        }
        let units: Row = first
            .split('`')
            .skip(1)
            .step_by(2)
            .map(|name| {
                name.trim_end_matches('/')
                    .split("::")
                    .map(str::to_owned)
                    .collect()
            })
            .collect();
        if !units.is_empty() {
            rows.push(units);
        }
    }
    assert!(
        !rows.is_empty(),
        "the Layers section has no table of modules"
    );
    rows
}

/// A unit of the list and its row (0 is the top).
#[derive(Debug)]
struct Unit {
    name: String,
    row: usize,
}

struct Map {
    units: Vec<(Vec<String>, usize)>,
}

impl Map {
    fn new(rows: &[Row]) -> Map {
        let mut units = Vec::new();
        let mut seen = BTreeSet::new();
        for (row, names) in rows.iter().enumerate() {
            for name in names {
                assert!(
                    seen.insert(name.clone()),
                    "`{}` is listed twice",
                    name.join("::")
                );
                units.push((name.clone(), row));
            }
        }
        Map { units }
    }

    /// The unit holding `path`: the longest listed prefix.
    fn unit(&self, path: &[String]) -> Option<Unit> {
        self.units
            .iter()
            .filter(|(name, _)| path.starts_with(name))
            .max_by_key(|(name, _)| name.len())
            .map(|(name, row)| Unit {
                name: name.join("::"),
                row: *row,
            })
    }
}

/// A token of Rust source, as much of one as this needs.
#[derive(Debug, PartialEq)]
enum Tok {
    Ident(String),
    PathSep,
    Open,
    Close,
    Comma,
    Semi,
    Other,
}

/// Rust source as tokens with their lines, without comments, strings or char literals.
fn lex(src: &str) -> Vec<(Tok, usize)> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            b'\n' => {
                line += 1;
                i += 1;
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i..].starts_with(b"/*") {
                        depth += 1;
                        i += 2;
                    } else if b[i..].starts_with(b"*/") {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        line += usize::from(b[i] == b'\n');
                        i += 1;
                    }
                }
            }
            b'"' => i = skip_string(b, i + 1, &mut line),
            b'r' | b'b' if raw_string_hashes(b, i).is_some() => {
                let (start, hashes) = raw_string_hashes(b, i).unwrap_or_default();
                let end: Vec<u8> = std::iter::once(b'"')
                    .chain(std::iter::repeat_n(b'#', hashes))
                    .collect();
                i = start;
                while i < b.len() && !b[i..].starts_with(&end) {
                    line += usize::from(b[i] == b'\n');
                    i += 1;
                }
                i += end.len();
            }
            b'b' if b.get(i + 1) == Some(&b'"') => i = skip_string(b, i + 2, &mut line),
            b'\'' => {
                // A char literal ('x', '\n', '\u{1F600}') or a lifetime ('a).
                if b.get(i + 1) == Some(&b'\\') {
                    i += 2;
                    while i < b.len() && b[i] != b'\'' {
                        i += 1;
                    }
                    i += 1;
                } else {
                    let width = src[i + 1..].chars().next().map_or(1, char::len_utf8);
                    if b.get(i + 1 + width) == Some(&b'\'') {
                        i += 2 + width;
                    } else {
                        i += 1;
                    }
                }
            }
            c if c == b'_' || c.is_ascii_alphabetic() => {
                let start = i;
                while i < b.len() && (b[i] == b'_' || b[i].is_ascii_alphanumeric()) {
                    i += 1;
                }
                out.push((Tok::Ident(src[start..i].to_owned()), line));
            }
            b':' if b.get(i + 1) == Some(&b':') => {
                out.push((Tok::PathSep, line));
                i += 2;
            }
            b'{' => {
                out.push((Tok::Open, line));
                i += 1;
            }
            b'}' => {
                out.push((Tok::Close, line));
                i += 1;
            }
            b',' => {
                out.push((Tok::Comma, line));
                i += 1;
            }
            b';' => {
                out.push((Tok::Semi, line));
                i += 1;
            }
            c if c.is_ascii_whitespace() => i += 1,
            _ => {
                out.push((Tok::Other, line));
                i += src[i..].chars().next().map_or(1, char::len_utf8);
            }
        }
    }
    out
}

/// Past a string literal's closing quote, from just after its opening one.
fn skip_string(b: &[u8], mut i: usize, line: &mut usize) -> usize {
    while i < b.len() && b[i] != b'"' {
        *line += usize::from(b[i] == b'\n');
        i += if b[i] == b'\\' { 2 } else { 1 };
    }
    i + 1
}

/// For a raw string (`r"`, `r#"`, `br##"`) starting at `i`: where its text starts and how
/// many `#` close it.
fn raw_string_hashes(b: &[u8], i: usize) -> Option<(usize, usize)> {
    if i > 0 && (b[i - 1] == b'_' || b[i - 1].is_ascii_alphanumeric()) {
        return None;
    }
    let mut j = i + usize::from(b[i] == b'b');
    if b.get(j) != Some(&b'r') {
        return None;
    }
    j += 1;
    let hashes = b[j..].iter().take_while(|&&c| c == b'#').count();
    (b.get(j + hashes) == Some(&b'"')).then_some((j + hashes + 1, hashes))
}

/// One path a file refers to, resolved from the crate root.
#[derive(Debug)]
struct Reference {
    line: usize,
    path: Vec<String>,
}

/// What `module` (the file's module path) refers to. `modules` is every module of the
/// crate, to tell a `use child::…` from an external crate's `use serde_json::…`.
fn references(src: &str, module: &[String], modules: &BTreeSet<Vec<String>>) -> Vec<Reference> {
    let toks = lex(src);
    let mut out = Vec::new();
    // The inline modules (`mod tests { … }`) around the current token, with the brace
    // depth each opened at.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < toks.len() {
        let here: Vec<String> = module
            .iter()
            .cloned()
            .chain(inline.iter().map(|(name, _)| name.clone()))
            .collect();
        match &toks[i].0 {
            Tok::Open => depth += 1,
            Tok::Close => {
                depth -= 1;
                if inline.last().is_some_and(|(_, at)| *at == depth) {
                    inline.pop();
                }
            }
            Tok::Ident(word) if word == "mod" => {
                if let (Some((Tok::Ident(name), _)), Some((Tok::Open, _))) =
                    (toks.get(i + 1), toks.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                }
            }
            Tok::Ident(word) if word == "use" => {
                let mut paths = Vec::new();
                i = use_tree(&toks, i + 1, Vec::new(), &mut paths);
                for (path, line) in paths {
                    if let Some(path) = resolve(&path, &here, modules, true) {
                        out.push(Reference { line, path });
                    }
                }
                continue;
            }
            Tok::Ident(word)
                if (word == "crate" || word == "super")
                    && matches!(toks.get(i + 1), Some((Tok::PathSep, _)))
                    && (i == 0 || toks[i - 1].0 != Tok::PathSep) =>
            {
                let line = toks[i].1;
                let mut path = vec![word.clone()];
                let mut j = i + 1;
                while let (Some((Tok::PathSep, _)), Some((Tok::Ident(seg), _))) =
                    (toks.get(j), toks.get(j + 1))
                {
                    path.push(seg.clone());
                    j += 2;
                }
                if let Some(path) = resolve(&path, &here, modules, false) {
                    out.push(Reference { line, path });
                }
                i = j;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Reads one use tree from `i` (after `use`, or inside braces), appending each of its
/// paths, prefixed by `prefix`, to `paths`; returns the index of the token that ended it.
fn use_tree(
    toks: &[(Tok, usize)],
    mut i: usize,
    mut prefix: Vec<String>,
    paths: &mut Vec<(Vec<String>, usize)>,
) -> usize {
    let line = toks.get(i).map_or(0, |t| t.1);
    while let Some((tok, _)) = toks.get(i) {
        match tok {
            // `as name` renames; the path is what precedes it.
            Tok::Ident(word) if word == "as" => i += 2,
            // `{self, …}` is the prefix itself.
            Tok::Ident(word) if word == "self" && !prefix.is_empty() => i += 1,
            Tok::Ident(segment) => {
                prefix.push(segment.clone());
                i += 1;
            }
            Tok::PathSep => i += 1,
            Tok::Open => {
                i += 1;
                while !matches!(toks.get(i), None | Some((Tok::Close, _))) {
                    i = use_tree(toks, i, prefix.clone(), paths);
                    if matches!(toks.get(i), Some((Tok::Comma, _))) {
                        i += 1;
                    }
                }
                return i + 1;
            }
            Tok::Comma | Tok::Close | Tok::Semi => break,
            // `*`
            Tok::Other => i += 1,
        }
    }
    if !prefix.is_empty() {
        paths.push((prefix, line));
    }
    i
}

/// `path` from the crate root, or `None` when it leaves the crate. `here` is the module
/// the path is written in; in a `use`, a path may also start at one of its children.
fn resolve(
    path: &[String],
    here: &[String],
    modules: &BTreeSet<Vec<String>>,
    in_use: bool,
) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    match first.as_str() {
        "crate" => Some(rest.to_vec()),
        "self" => Some(here.iter().chain(rest).cloned().collect()),
        "super" => {
            let mut base = here.to_vec();
            base.pop();
            let mut rest = rest;
            while let Some(("super", tail)) = rest.split_first().map(|(s, t)| (s.as_str(), t)) {
                base.pop();
                rest = tail;
            }
            Some(base.into_iter().chain(rest.iter().cloned()).collect())
        }
        _ if in_use => {
            let child: Vec<String> = here.iter().chain([first]).cloned().collect();
            modules
                .contains(&child)
                .then(|| child.into_iter().chain(rest.iter().cloned()).collect())
        }
        _ => None,
    }
}

/// The module path of a file under `src/`.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("a file under src/");
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// One file of the crate and the paths it refers to.
struct Source {
    /// As shown in messages: `src/…`.
    shown: String,
    module: Vec<String>,
    references: Vec<Reference>,
}

/// Every file under `src/` but the crate roots: `lib.rs` only declares modules, and
/// `main.rs` is the binary's crate, which reaches the library only through `caliban::app`.
fn read_crate(root: &Path) -> Vec<Source> {
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    files.retain(|f| f != &src.join("main.rs") && f != &src.join("lib.rs"));
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_of(&src, f)).collect();
    files
        .iter()
        .map(|file| {
            let module = module_of(&src, file);
            let text = fs::read_to_string(file).expect("a readable source file");
            Source {
                shown: file
                    .strip_prefix(root)
                    .unwrap_or(file)
                    .display()
                    .to_string(),
                references: references(&text, &module, &modules),
                module,
            }
        })
        .filter(|source| !OFF_THE_MAP.contains(&source.module[0].as_str()))
        .collect()
}

/// Every reference that climbs the table, or goes sideways in it, and every module the
/// table and the code do not agree on, as messages.
fn climbs(map: &Map, sources: &[Source], pending: &[(&str, &str, &str)]) -> Vec<String> {
    let mut problems = Vec::new();
    for (name, _) in &map.units {
        if !sources.iter().any(|s| s.module.starts_with(name)) {
            problems.push(format!(
                "ARCHITECTURE.md's Layers table lists `{}`, which is no module under src/",
                name.join("::")
            ));
        }
    }
    let mut pending_seen = BTreeSet::new();
    for source in sources {
        let Some(from) = map.unit(&source.module) else {
            problems.push(format!(
                "{}: module `{}` is in no row of ARCHITECTURE.md's Layers table",
                source.shown,
                source.module.join("::")
            ));
            continue;
        };
        // The first reference to each unit it should not reach is enough to show.
        let mut found = BTreeMap::new();
        for reference in &source.references {
            let Some(to) = map.unit(&reference.path) else {
                problems.push(format!(
                    "{}:{}: `crate::{}` is in no row of ARCHITECTURE.md's Layers table",
                    source.shown,
                    reference.line,
                    reference.path.join("::")
                ));
                continue;
            };
            if to.name == from.name || to.row > from.row {
                continue;
            }
            let known = pending
                .iter()
                .any(|(file, unit, _)| *file == source.shown && *unit == to.name);
            if known {
                pending_seen.insert((source.shown.clone(), to.name.clone()));
            } else {
                found.entry(to.name.clone()).or_insert((reference, to));
            }
        }
        for (reference, to) in found.into_values() {
            let how = if to.row == from.row {
                "a peer in its own row"
            } else {
                "in a higher row"
            };
            problems.push(format!(
                "{}:{}: `{}` (row {}) uses `crate::{}`, which is `{}`, {how} (row {})",
                source.shown,
                reference.line,
                from.name,
                from.row + 1,
                reference.path.join("::"),
                to.name,
                to.row + 1
            ));
        }
    }
    for (file, unit, owner) in pending {
        if !pending_seen.contains(&(file.to_string(), unit.to_string())) {
            problems.push(format!(
                "PENDING lists {file} → `{unit}` ({owner}), which no longer climbs: remove it"
            ));
        }
    }
    problems
}

/// The cycles among the crate's files, a file's references to its own ancestors and
/// descendants aside (a child uses its parent's types, a parent re-exports its children):
/// between units the table already forbids them, so these are the ones inside a unit,
/// between sibling files (`acp::prompt` and `acp::session`, say).
fn sibling_cycles(sources: &[Source]) -> Vec<String> {
    let files: Vec<&Vec<String>> = sources.iter().map(|s| &s.module).collect();
    // Each file's edges to the files it names, with the first place it names each.
    let mut edges: BTreeMap<&Vec<String>, BTreeMap<&Vec<String>, String>> = BTreeMap::new();
    for source in sources {
        let out = edges.entry(&source.module).or_default();
        for reference in &source.references {
            let Some(target) = files
                .iter()
                .filter(|f| reference.path.starts_with(f))
                .max_by_key(|f| f.len())
            else {
                continue;
            };
            if target.starts_with(&source.module) || source.module.starts_with(target) {
                continue;
            }
            out.entry(*target)
                .or_insert_with(|| format!("{}:{}", source.shown, reference.line));
        }
    }
    let reach = |from: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from];
        while let Some(next) = todo.pop() {
            for target in edges.get(next).into_iter().flat_map(BTreeMap::keys) {
                if seen.insert(*target) {
                    todo.push(target);
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&Vec<String>, BTreeSet<&Vec<String>>> =
        files.iter().map(|f| (*f, reach(f))).collect();
    let mut cycles: BTreeSet<Vec<&Vec<String>>> = BTreeSet::new();
    for file in &files {
        let members: Vec<&Vec<String>> = files
            .iter()
            .copied()
            .filter(|other| reaches[file].contains(other) && reaches[other].contains(file))
            .collect();
        if members.len() > 1 {
            cycles.insert(members);
        }
    }
    let mut problems = Vec::new();
    for members in cycles {
        let name = |m: &Vec<String>| m.join("::");
        let mut lines = vec![format!(
            "a cycle among {}:",
            members
                .iter()
                .map(|m| format!("`{}`", name(m)))
                .collect::<Vec<_>>()
                .join(", ")
        )];
        for from in &members {
            for (to, at) in &edges[*from] {
                if members.contains(to) {
                    lines.push(format!("  {at}: `{}` uses `{}`", name(from), name(to)));
                }
            }
        }
        problems.push(lines.join("\n"));
    }
    problems
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_module_uses_one_in_its_own_row_or_above() {
    let architecture = fs::read_to_string(root().join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let map = Map::new(&parse_layers(&architecture));
    let problems = climbs(&map, &read_crate(root()), PENDING);
    assert!(
        problems.is_empty(),
        "a module may use only modules in rows below its own in ARCHITECTURE.md's Layers \
         table:\n{}",
        problems.join("\n")
    );
}

#[test]
fn sibling_files_form_no_cycle() {
    let problems = sibling_cycles(&read_crate(root()));
    assert!(
        problems.is_empty(),
        "the files of a module must not use each other in a cycle (move what both need \
         into one of them, or into a third below both):\n{}",
        problems.join("\n")
    );
}

// The checks above are only as good as the reading below them.

fn paths(src: &str, module: &[&str], children: &[&[&str]]) -> Vec<String> {
    let owned = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let modules: BTreeSet<Vec<String>> = children.iter().map(|m| owned(m)).collect();
    references(src, &owned(module), &modules)
        .into_iter()
        .map(|r| format!("{}:{}", r.line, r.path.join("::")))
        .collect()
}

#[test]
fn comments_strings_and_chars_name_no_module() {
    let src = r##"
        // crate::a
        /* crate::b /* nested */ crate::c */
        let s = "crate::d \" crate::e";
        let r = r#"crate::f " crate::g"#;
        let b = b"crate::h";
        let c = '"'; let l: &'static str = crate::i::J;
    "##;
    assert_eq!(paths(src, &["m"], &[]), ["7:i::J"]);
}

#[test]
fn use_trees_resolve_from_the_crate_root() {
    let src = "use crate::{a::{self, b}, c::D as E};\n\
               use super::super::x;\n\
               use super::y::*;\n\
               use child::z;\n\
               use serde_json::Value;\n\
               pub(crate) use self::child::w;\n\
               fn f() { crate::p::q(); super::r(); pub(crate) fn g() {} }\n";
    assert_eq!(
        paths(src, &["m", "n"], &[&["m", "n", "child"]]),
        [
            "1:a",
            "1:a::b",
            "1:c::D",
            "2:x",
            "3:m::y",
            "4:m::n::child::z",
            "6:m::n::child::w",
            "7:p::q",
            "7:m::r",
        ]
    );
}

#[test]
fn super_inside_an_inline_module_starts_there() {
    let src =
        "fn f() {}\nmod tests {\n    use super::f;\n    use super::super::g;\n}\nuse super::h;\n";
    assert_eq!(
        paths(src, &["m", "n"], &[]),
        ["3:m::n::f", "4:m::g", "6:m::h"]
    );
}

fn source(shown: &str, module: &str, uses: &[&str]) -> Source {
    let split = |p: &str| p.split("::").map(str::to_owned).collect::<Vec<_>>();
    Source {
        shown: shown.to_owned(),
        module: split(module),
        references: uses
            .iter()
            .map(|path| Reference {
                line: 1,
                path: split(path),
            })
            .collect(),
    }
}

#[test]
fn an_import_that_climbs_or_crosses_a_row_fails() {
    let table = "# Map\n\n## Layers\n\n| Modules | What |\n|---|---|\n\
                 | `top` | a |\n| `mid` `peer` | b |\n| `low/` `low::deep` | c |\n\n## Next\n";
    let map = Map::new(&parse_layers(table));
    let sources = [
        source("src/top.rs", "top", &["mid::X", "low::deep::Y"]),
        source("src/mid.rs", "mid", &["low::Z", "top::W", "peer::V"]),
        source("src/peer.rs", "peer", &[]),
        source("src/low/mod.rs", "low", &["low::deep::U"]),
        source("src/low/deep.rs", "low::deep", &[]),
        source("src/stray.rs", "stray", &[]),
    ];
    assert_eq!(
        climbs(&map, &sources, &[("src/peer.rs", "top", "someone")]),
        [
            "src/mid.rs:1: `mid` (row 2) uses `crate::peer::V`, which is `peer`, a peer in its \
             own row (row 2)",
            "src/mid.rs:1: `mid` (row 2) uses `crate::top::W`, which is `top`, in a higher row \
             (row 1)",
            "src/low/mod.rs:1: `low` (row 3) uses `crate::low::deep::U`, which is `low::deep`, \
             a peer in its own row (row 3)",
            "src/stray.rs: module `stray` is in no row of ARCHITECTURE.md's Layers table",
            "PENDING lists src/peer.rs → `top` (someone), which no longer climbs: remove it",
        ]
    );
}

#[test]
fn a_cycle_between_sibling_files_fails_and_a_parent_is_no_sibling() {
    let sources = [
        source("src/m/mod.rs", "m", &["m::a::A", "m::b::B"]),
        source("src/m/a.rs", "m::a", &["m::M", "m::b::B"]),
        source("src/m/b.rs", "m::b", &["m::M", "m::a::A"]),
        source("src/n/c.rs", "n::c", &["n::d"]),
        source("src/n/d.rs", "n::d", &[]),
    ];
    assert_eq!(
        sibling_cycles(&sources),
        [
            "a cycle among `m::a`, `m::b`:\n  src/m/a.rs:1: `m::a` uses `m::b`\n  \
          src/m/b.rs:1: `m::b` uses `m::a`"
        ]
    );
}
