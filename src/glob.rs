//! Glob patterns, shared by the `Glob` tool and by permission rules. A pattern is parsed once
//! into a small Thompson NFA (`Inst`) and matched by simulating every live state at once, so
//! matching costs O(text × pattern) no matter how many `*` or `{a,b}` the pattern holds: a
//! pattern such as `*a*a*a*a*b` cannot backtrack exponentially on a long text. This module knows
//! nothing about the filesystem or permissions; it matches `&str` against `&str`.
//!
//! Syntax: `*`, `?`, `**` (as a whole path component), `[abc]`, `[a-z]`, `[!x]`/`[^x]`,
//! `{a,b,c}` (nestable, may hold wildcards), and `\` to escape the next character.

use std::fmt;

/// How deeply `{…}` may nest. Parsing recurses once per level, so the cap keeps hostile
/// patterns such as `{{{{…` from exhausting the stack.
const MAX_NESTING: usize = 32;

/// Largest compiled program, in instructions. The program grows linearly with the pattern, so
/// this only bounds the memory a very long pattern can claim per match.
const MAX_PROGRAM: usize = 1 << 16;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GlobOptions {
    /// True: `*`, `?` and classes never match `/`, and only `**` crosses directories (paths).
    /// False: `*` matches any run of characters, `/` included (commands, URLs, tool names).
    pub literal_separator: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GlobError {
    /// A `[` with no closing `]`; `offset` is the `[`'s character offset.
    UnclosedClass { offset: usize },
    /// A `{` with no closing `}`; `offset` is the `{`'s character offset.
    UnclosedAlternation { offset: usize },
    /// A class range that runs backwards, like `[z-a]`.
    InvalidRange { start: char, end: char },
    /// A `\` at the very end of the pattern, escaping nothing.
    DanglingEscape,
    /// More than `MAX_NESTING` levels of `{…}`.
    TooDeep,
    /// The compiled program would exceed `MAX_PROGRAM` instructions.
    TooComplex,
}

impl fmt::Display for GlobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GlobError::UnclosedClass { offset } => {
                write!(f, "unclosed '[' at character {offset}")
            }
            GlobError::UnclosedAlternation { offset } => {
                write!(f, "unclosed '{{' at character {offset}")
            }
            GlobError::InvalidRange { start, end } => {
                write!(f, "invalid character range '{start}-{end}'")
            }
            GlobError::DanglingEscape => f.write_str("dangling '\\' at the end of the pattern"),
            GlobError::TooDeep => write!(f, "more than {MAX_NESTING} nested '{{' groups"),
            GlobError::TooComplex => f.write_str("pattern is too complex"),
        }
    }
}

impl std::error::Error for GlobError {}

/// A compiled glob pattern.
#[derive(Clone, Debug)]
pub struct Glob {
    /// The text to compare against when the pattern has no wildcards at all (escapes
    /// removed). Most permission rules name a tool literally, and a string compare spares
    /// the NFA's allocations on every decision.
    literal: Option<String>,
    prog: Vec<Inst>,
}

impl Glob {
    pub fn new(pattern: &str, opts: GlobOptions) -> Result<Glob, GlobError> {
        let chars: Vec<char> = pattern.chars().collect();
        let mut parser = Parser {
            chars: &chars,
            pos: 0,
        };
        let nodes = parser.sequence(0, false)?;
        // `sequence` at depth 0 only stops at the end: `,` and `}` are literals outside braces.
        debug_assert_eq!(
            parser.pos,
            chars.len(),
            "top-level sequence stops at the end"
        );
        let literal = nodes
            .iter()
            .map(|node| match node {
                Node::Char(ch) => Some(*ch),
                _ => None,
            })
            .collect::<Option<String>>();
        let mut compiler = Compiler {
            prog: Vec::new(),
            cross: !opts.literal_separator,
        };
        compiler.sequence(&nodes)?;
        compiler.push(Inst::Match)?;
        Ok(Glob {
            literal,
            prog: compiler.prog,
        })
    }

    /// Whether the whole of `text` matches the pattern.
    pub fn is_match(&self, text: &str) -> bool {
        if let Some(literal) = &self.literal {
            return literal == text;
        }
        let mut current = StateSet::new(self.prog.len());
        let mut next = StateSet::new(self.prog.len());
        let mut stack = Vec::new();
        self.add_state(&mut current, 0, &mut stack);
        for ch in text.chars() {
            if current.is_empty() {
                return false;
            }
            for &pc in &current.dense {
                let advance = match &self.prog[pc] {
                    Inst::Char(want) => *want == ch,
                    Inst::Any { cross } => *cross || ch != '/',
                    Inst::Class {
                        negated,
                        ranges,
                        cross,
                    } => {
                        (*cross || ch != '/')
                            && ranges.iter().any(|&(lo, hi)| lo <= ch && ch <= hi) != *negated
                    }
                    // Epsilon instructions never sit in a state set, and `Match` only counts
                    // once the text is used up.
                    Inst::Match | Inst::Split(..) | Inst::Jmp(_) => false,
                };
                if advance {
                    self.add_state(&mut next, pc + 1, &mut stack);
                }
            }
            std::mem::swap(&mut current, &mut next);
            next.clear();
        }
        current
            .dense
            .iter()
            .any(|&pc| matches!(self.prog[pc], Inst::Match))
    }

    /// Adds `pc` and everything reachable from it without consuming a character.
    /// `stack` is scratch space, passed in so a match allocates it once rather than per step.
    fn add_state(&self, set: &mut StateSet, pc: usize, stack: &mut Vec<usize>) {
        stack.push(pc);
        while let Some(pc) = stack.pop() {
            if !set.visit(pc) {
                continue;
            }
            match self.prog[pc] {
                Inst::Split(first, second) => {
                    // Push the second branch first so the first is explored first; order does
                    // not change the answer, only keeps the walk predictable when debugging.
                    stack.push(second);
                    stack.push(first);
                }
                Inst::Jmp(target) => stack.push(target),
                _ => set.dense.push(pc),
            }
        }
    }
}

/// Parsed pattern, before compilation.
#[derive(Debug)]
enum Node {
    Char(char),
    /// `?`
    Any,
    /// `*`
    Star,
    /// `**/`: zero or more whole directories, i.e. `(.*/)?`.
    DeepDirs,
    /// `**` as the last component: anything at all, `/` included.
    DeepAny,
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
    Alt(Vec<Vec<Node>>),
}

struct Parser<'a> {
    chars: &'a [char],
    pos: usize,
}

impl Parser<'_> {
    /// Parses up to the end, or (inside braces) up to an unescaped `,` or `}` left unconsumed.
    fn sequence(&mut self, depth: usize, in_alt: bool) -> Result<Vec<Node>, GlobError> {
        let mut nodes = Vec::new();
        while let Some(&ch) = self.chars.get(self.pos) {
            match ch {
                ',' | '}' if in_alt => break,
                '\\' => {
                    let escaped = *self
                        .chars
                        .get(self.pos + 1)
                        .ok_or(GlobError::DanglingEscape)?;
                    nodes.push(Node::Char(escaped));
                    self.pos += 2;
                }
                '?' => {
                    nodes.push(Node::Any);
                    self.pos += 1;
                }
                '*' => nodes.push(self.star(in_alt)),
                '[' => nodes.push(self.class()?),
                '{' => {
                    if depth >= MAX_NESTING {
                        return Err(GlobError::TooDeep);
                    }
                    let open = self.pos;
                    self.pos += 1;
                    let mut alternatives = Vec::new();
                    loop {
                        alternatives.push(self.sequence(depth + 1, true)?);
                        match self.chars.get(self.pos) {
                            Some(',') => self.pos += 1,
                            Some('}') => {
                                self.pos += 1;
                                break;
                            }
                            _ => return Err(GlobError::UnclosedAlternation { offset: open }),
                        }
                    }
                    nodes.push(Node::Alt(alternatives));
                }
                _ => {
                    nodes.push(Node::Char(ch));
                    self.pos += 1;
                }
            }
        }
        Ok(nodes)
    }

    /// A run of `*`. Two or more stars form `**` only as a whole path component (preceded by
    /// the start, `/`, or a brace boundary, and followed by the end, `/`, or a brace boundary);
    /// elsewhere they mean the same as one `*`, as in globset and gitignore.
    fn star(&mut self, in_alt: bool) -> Node {
        let start = self.pos;
        while self.chars.get(self.pos) == Some(&'*') {
            self.pos += 1;
        }
        if self.pos - start == 1 {
            return Node::Star;
        }
        let before = start.checked_sub(1).map(|i| self.chars[i]);
        let after = self.chars.get(self.pos).copied();
        let starts_component = match before {
            None | Some('/') => true,
            Some('{' | ',') => in_alt,
            _ => false,
        };
        if !starts_component {
            return Node::Star;
        }
        match after {
            Some('/') => {
                self.pos += 1;
                Node::DeepDirs
            }
            None => Node::DeepAny,
            Some(',' | '}') if in_alt => Node::DeepAny,
            _ => Node::Star,
        }
    }

    fn class(&mut self) -> Result<Node, GlobError> {
        let open = self.pos;
        self.pos += 1;
        let negated = matches!(self.chars.get(self.pos), Some('!' | '^'));
        if negated {
            self.pos += 1;
        }
        let mut ranges = Vec::new();
        let mut first = true;
        loop {
            let mut lo = *self
                .chars
                .get(self.pos)
                .ok_or(GlobError::UnclosedClass { offset: open })?;
            // A `]` straight after `[` (or `[!`) is a member, so `[]]` matches `]`.
            if lo == ']' && !first {
                self.pos += 1;
                break;
            }
            first = false;
            self.pos += 1;
            if lo == '\\' {
                lo = *self
                    .chars
                    .get(self.pos)
                    .ok_or(GlobError::UnclosedClass { offset: open })?;
                self.pos += 1;
            }
            // `a-z` is a range unless the `-` is last (`[a-]` holds `a` and `-`).
            let is_range = self.chars.get(self.pos) == Some(&'-')
                && self.chars.get(self.pos + 1).is_some_and(|&c| c != ']');
            if !is_range {
                ranges.push((lo, lo));
                continue;
            }
            self.pos += 1;
            let mut hi = self.chars[self.pos];
            self.pos += 1;
            if hi == '\\' {
                hi = *self
                    .chars
                    .get(self.pos)
                    .ok_or(GlobError::UnclosedClass { offset: open })?;
                self.pos += 1;
            }
            if hi < lo {
                return Err(GlobError::InvalidRange { start: lo, end: hi });
            }
            ranges.push((lo, hi));
        }
        Ok(Node::Class { negated, ranges })
    }
}

/// One NFA instruction. Only `Char`, `Any`, `Class` and `Match` are ever stored in a state
/// set; `Split` and `Jmp` are followed while the set is built.
#[derive(Clone, Debug)]
enum Inst {
    Char(char),
    /// One character; `/` only when `cross`.
    Any {
        cross: bool,
    },
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
        cross: bool,
    },
    Split(usize, usize),
    Jmp(usize),
    Match,
}

struct Compiler {
    prog: Vec<Inst>,
    /// Whether `*`, `?` and classes may match `/` (`!literal_separator`).
    cross: bool,
}

impl Compiler {
    fn push(&mut self, inst: Inst) -> Result<usize, GlobError> {
        if self.prog.len() >= MAX_PROGRAM {
            return Err(GlobError::TooComplex);
        }
        self.prog.push(inst);
        Ok(self.prog.len() - 1)
    }

    fn sequence(&mut self, nodes: &[Node]) -> Result<(), GlobError> {
        for node in nodes {
            self.node(node)?;
        }
        Ok(())
    }

    fn node(&mut self, node: &Node) -> Result<(), GlobError> {
        match node {
            Node::Char(ch) => {
                self.push(Inst::Char(*ch))?;
            }
            Node::Any => {
                self.push(Inst::Any { cross: self.cross })?;
            }
            Node::Class { negated, ranges } => {
                self.push(Inst::Class {
                    negated: *negated,
                    ranges: ranges.clone(),
                    cross: self.cross,
                })?;
            }
            Node::Star => self.repeat_any(self.cross)?,
            Node::DeepAny => self.repeat_any(true)?,
            Node::DeepDirs => {
                // Split(body, end); body: (any)* '/'
                let split = self.push(Inst::Split(0, 0))?;
                self.repeat_any(true)?;
                self.push(Inst::Char('/'))?;
                let end = self.prog.len();
                self.prog[split] = Inst::Split(split + 1, end);
            }
            Node::Alt(alternatives) => {
                // Split(a1, next); a1; Jmp(end); next: Split(a2, next2); a2; Jmp(end); …; an
                let mut jumps = Vec::new();
                for (idx, alternative) in alternatives.iter().enumerate() {
                    let is_last = idx + 1 == alternatives.len();
                    if is_last {
                        self.sequence(alternative)?;
                    } else {
                        let split = self.push(Inst::Split(0, 0))?;
                        self.sequence(alternative)?;
                        jumps.push(self.push(Inst::Jmp(0))?);
                        let next = self.prog.len();
                        self.prog[split] = Inst::Split(split + 1, next);
                    }
                }
                let end = self.prog.len();
                for jump in jumps {
                    self.prog[jump] = Inst::Jmp(end);
                }
            }
        }
        Ok(())
    }

    /// `loop: Split(body, end); body: Any; Jmp(loop); end:`
    fn repeat_any(&mut self, cross: bool) -> Result<(), GlobError> {
        let split = self.push(Inst::Split(0, 0))?;
        self.push(Inst::Any { cross })?;
        self.push(Inst::Jmp(split))?;
        let end = self.prog.len();
        self.prog[split] = Inst::Split(split + 1, end);
        Ok(())
    }
}

/// A set of program counters with O(1) insert and membership, reset in O(size of the set).
struct StateSet {
    /// Consuming (and `Match`) instructions in the set, in insertion order.
    dense: Vec<usize>,
    /// Every pc visited while building the set, epsilon instructions included.
    seen: Vec<bool>,
    /// Which `seen` entries to reset in `clear`.
    touched: Vec<usize>,
}

impl StateSet {
    fn new(len: usize) -> StateSet {
        StateSet {
            dense: Vec::new(),
            seen: vec![false; len],
            touched: Vec::new(),
        }
    }

    /// Marks `pc` visited; false when it already was.
    fn visit(&mut self, pc: usize) -> bool {
        if self.seen[pc] {
            return false;
        }
        self.seen[pc] = true;
        self.touched.push(pc);
        true
    }

    fn is_empty(&self) -> bool {
        self.dense.is_empty()
    }

    fn clear(&mut self) {
        for &pc in &self.touched {
            self.seen[pc] = false;
        }
        self.touched.clear();
        self.dense.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATH: GlobOptions = GlobOptions {
        literal_separator: true,
    };
    const TEXT: GlobOptions = GlobOptions {
        literal_separator: false,
    };

    fn path(pattern: &str) -> Glob {
        Glob::new(pattern, PATH).expect("test pattern is valid")
    }

    fn text(pattern: &str) -> Glob {
        Glob::new(pattern, TEXT).expect("test pattern is valid")
    }

    #[test]
    fn literals_and_question_mark() {
        let glob = path("src/ma?n.rs");
        assert!(glob.is_match("src/main.rs"));
        assert!(!glob.is_match("src/mai.rs"));
        assert!(!glob.is_match("src/main.rsx"));
        assert!(!path("a?b").is_match("a/b"));
        assert!(text("a?b").is_match("a/b"));
        assert!(path("").is_match(""));
        assert!(!path("").is_match("a"));
    }

    #[test]
    fn star_respects_literal_separator() {
        assert!(path("*.rs").is_match("main.rs"));
        assert!(!path("*.rs").is_match("src/main.rs"));
        assert!(text("*.rs").is_match("src/main.rs"));
        assert!(text("git *").is_match("git log --oneline"));
        assert!(text("git *").is_match("git "));
        assert!(!text("git *").is_match("git"));
        assert!(path("src/*").is_match("src/"));
        // `**` inside a component is just `*`.
        assert!(path("a**b").is_match("axxb"));
        assert!(!path("a**b").is_match("a/b"));
    }

    #[test]
    fn double_star_components() {
        let prefix = path("**/x");
        assert!(prefix.is_match("x"));
        assert!(prefix.is_match("a/x"));
        assert!(prefix.is_match("a/b/x"));
        assert!(!prefix.is_match("ax"));
        assert!(!prefix.is_match("a/bx"));

        let suffix = path("a/**");
        assert!(suffix.is_match("a/b"));
        assert!(suffix.is_match("a/b/c"));
        assert!(!suffix.is_match("a"));
        assert!(!suffix.is_match("ab/c"));

        let middle = path("a/**/b");
        assert!(middle.is_match("a/b"));
        assert!(middle.is_match("a/x/b"));
        assert!(middle.is_match("a/x/y/b"));
        assert!(!middle.is_match("a/xb"));

        assert!(path("**").is_match("any/thing/at/all"));
        assert!(path("**/*.rs").is_match("src/deep/lib.rs"));
        assert!(path("**/*.rs").is_match("lib.rs"));
        assert!(!path("**/*.rs").is_match("lib.rsx"));
    }

    #[test]
    fn classes() {
        assert!(path("[abc]").is_match("b"));
        assert!(!path("[abc]").is_match("d"));
        assert!(path("[a-z]x").is_match("qx"));
        assert!(!path("[a-z]x").is_match("Qx"));
        assert!(path("[!a]").is_match("b"));
        assert!(!path("[!a]").is_match("a"));
        assert!(path("[^a]").is_match("b"));
        assert!(path("[]]").is_match("]"));
        assert!(path("[a-]").is_match("-"));
        assert!(path("[\\]]").is_match("]"));
        assert!(!path("[!a]").is_match("/"));
        assert!(text("[!a]").is_match("/"));
        assert_eq!(
            Glob::new("[z-a]", PATH).unwrap_err(),
            GlobError::InvalidRange {
                start: 'z',
                end: 'a'
            }
        );
    }

    #[test]
    fn alternation() {
        let glob = path("*.{rs,toml}");
        assert!(glob.is_match("main.rs"));
        assert!(glob.is_match("Cargo.toml"));
        assert!(!glob.is_match("README.md"));
        let nested = path("{src/{a,b*},tests}/x");
        assert!(nested.is_match("src/a/x"));
        assert!(nested.is_match("src/bcd/x"));
        assert!(nested.is_match("tests/x"));
        assert!(!nested.is_match("src/c/x"));
        assert!(path("x{,y}").is_match("x"));
        assert!(path("x{,y}").is_match("xy"));
        assert!(path("{**/,}z").is_match("a/b/z"));
        // Outside braces `,` and `}` are literals.
        assert!(path("a,b}").is_match("a,b}"));
    }

    #[test]
    fn escapes() {
        assert!(path("\\*").is_match("*"));
        assert!(!path("\\*").is_match("x"));
        assert!(path("a\\{b").is_match("a{b"));
        assert_eq!(
            Glob::new("abc\\", PATH).unwrap_err(),
            GlobError::DanglingEscape
        );
    }

    #[test]
    fn errors() {
        assert_eq!(
            Glob::new("a[bc", PATH).unwrap_err(),
            GlobError::UnclosedClass { offset: 1 }
        );
        assert_eq!(
            Glob::new("x{a,b", PATH).unwrap_err(),
            GlobError::UnclosedAlternation { offset: 1 }
        );
        let deep = "{".repeat(MAX_NESTING + 1);
        assert_eq!(Glob::new(&deep, PATH).unwrap_err(), GlobError::TooDeep);
        let huge = "*".repeat(MAX_PROGRAM);
        let huge = huge.replace("**", "*a");
        assert_eq!(Glob::new(&huge, PATH).unwrap_err(), GlobError::TooComplex);
        assert_eq!(
            GlobError::UnclosedClass { offset: 3 }.to_string(),
            "unclosed '[' at character 3"
        );
    }

    #[test]
    fn no_exponential_backtracking() {
        let glob = text("*a*a*a*a*a*a*a*a*a*a*b");
        let haystack = "a".repeat(20_000);
        let start = std::time::Instant::now();
        assert!(!glob.is_match(&haystack));
        // A backtracking matcher needs longer than the age of the universe here; the NFA
        // needs about a millisecond. The bound is generous for slow CI machines.
        assert!(start.elapsed() < std::time::Duration::from_secs(5));
        assert!(glob.is_match(&format!("{haystack}b")));
    }

    #[test]
    fn unicode_is_matched_per_character() {
        assert!(path("?").is_match("é"));
        assert!(path("[à-ü]").is_match("é"));
        assert!(path("*/ü").is_match("ä/ü"));
    }
}
