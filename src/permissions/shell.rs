//! The Bash command splitter behind compound-command permissions. An allow rule such as
//! `Bash(git *)` must cover every command a line runs, not just its first word, so this
//! module reads a command the way the shell will (quotes, escapes, `&&`, `;`, `|`, `$(…)`,
//! backticks, subshells, redirections, here-documents) and hands back the pieces.
//!
//! It is the security boundary for allow rules: every command the shell would run must come
//! back as a piece of its own, never hidden inside a piece that looks harmless. Where it is
//! unsure it returns an extra piece or gives up (`None`); both only make allow rules match
//! less often. It knows nothing about rules or tools.

/// Most levels of `$(…)`, backticks, `${…}` and `( … )` the Bash splitter follows. Deeper commands are
/// treated as unparseable, which no allow rule matches.
const MAX_SHELL_NESTING: usize = 16;

/// Splits a shell command into the pieces an allow rule must each cover: the simple commands
/// separated by unquoted `;`, `&&`, `||`, `|`, `&` and newlines (also inside `( … )`), the
/// commands inside `$(…)`, backticks and `<(…)`/`>(…)` (in addition to the command holding
/// them), and each file redirection as a piece of its own, such as `> out.txt`, so that
/// `Bash(git *)` does not allow `git log > ~/.bashrc`. Redirections that touch no file
/// (`2>&1`, `>/dev/null`, here-documents) are dropped. Returns `None` when the quoting or
/// nesting does not balance; callers then let no allow rule match.
///
/// This is a conservative reading, not a shell: anything it misreads becomes an extra piece,
/// which can only make an allow rule less likely to match. (A here-document's body lines, for
/// one, become pieces of their own.)
pub(super) fn split_command(command: &str) -> Option<Vec<String>> {
    let chars: Vec<char> = command.chars().collect();
    let mut splitter = Splitter {
        chars: &chars,
        pos: 0,
        depth: 0,
        segments: Vec::new(),
        heredocs: Vec::new(),
    };
    splitter.list(false)?;
    Some(splitter.segments)
}

struct Splitter<'a> {
    chars: &'a [char],
    pos: usize,
    depth: usize,
    segments: Vec<String>,
    /// Here-documents whose bodies start at the next unquoted newline.
    heredocs: Vec<Heredoc>,
}

struct Heredoc {
    delimiter: String,
    /// `<<-` strips leading tabs from body lines and the delimiter line.
    strip_tabs: bool,
    /// A quoted delimiter (`<<'EOF'`) turns off expansion in the body.
    quoted: bool,
}

impl Splitter<'_> {
    fn peek(&self, offset: usize) -> Option<char> {
        self.chars.get(self.pos + offset).copied()
    }

    fn starts_with(&self, text: &str) -> bool {
        text.chars()
            .enumerate()
            .all(|(offset, ch)| self.peek(offset) == Some(ch))
    }

    /// Reads commands up to the end or, when `in_parens`, up to and including the matching
    /// `)`, pushing each finished simple command onto `segments`.
    fn list(&mut self, in_parens: bool) -> Option<()> {
        let mut current = String::new();
        loop {
            let Some(ch) = self.peek(0) else {
                self.finish(&mut current);
                // A here-document never closed would swallow the rest of the command.
                return (!in_parens && self.heredocs.is_empty()).then_some(());
            };
            match ch {
                '\\' | '\'' | '"' => self.quoted(&mut current)?,
                '`' => self.backticks(&mut current, false)?,
                '$' if self.peek(1) == Some('\'') => self.quoted(&mut current)?,
                '$' if self.peek(1) == Some('{') => self.parameter(&mut current, false)?,
                '$' | '<' | '>' if self.peek(1) == Some('(') => self.substitution(&mut current)?,
                // A comment hides quotes and separators from the shell, so it must hide them
                // from us too: `ls # '` would otherwise open a quote the shell never sees.
                '#' if at_word_start(&current) => {
                    while self.peek(0).is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                '\n' => {
                    self.finish(&mut current);
                    self.pos += 1;
                    self.heredoc_bodies()?;
                }
                ')' => {
                    if !in_parens {
                        return None;
                    }
                    self.pos += 1;
                    self.finish(&mut current);
                    return Some(());
                }
                '(' => {
                    // A subshell: its commands are pieces like any other.
                    self.finish(&mut current);
                    self.pos += 1;
                    self.nested(|splitter| splitter.list(true))?;
                }
                '&' if self.peek(1) == Some('>') => self.redirect(&current)?,
                ';' | '&' | '|' => {
                    self.finish(&mut current);
                    self.pos += 1;
                }
                '<' | '>' => self.redirect(&current)?,
                _ if ch.is_ascii_digit() && at_word_start(&current) && self.fd_redirect() => {
                    self.redirect(&current)?
                }
                _ => {
                    current.push(ch);
                    self.pos += 1;
                }
            }
        }
    }

    fn finish(&mut self, current: &mut String) {
        let piece = current.trim();
        if !piece.is_empty() {
            self.segments.push(piece.to_owned());
        }
        current.clear();
    }

    /// Skips the bodies of the here-documents opened on the line just ended. A body is data,
    /// not commands, but with an unquoted delimiter the shell expands `$(…)` and backticks in
    /// it, and joins a line ending in `\` to the next before comparing it with the delimiter
    /// (`E\` then `OF` ends an `EOF` body there); rather than follow either, such a body makes
    /// the command unparseable. A body that never reaches its delimiter does too.
    fn heredoc_bodies(&mut self) -> Option<()> {
        for heredoc in std::mem::take(&mut self.heredocs) {
            loop {
                let start = self.pos;
                if start >= self.chars.len() {
                    return None;
                }
                let len = self.chars[start..]
                    .iter()
                    .position(|&c| c == '\n')
                    .unwrap_or(self.chars.len() - start);
                let line = &self.chars[start..start + len];
                self.pos = (start + len + 1).min(self.chars.len());
                let trimmed = if heredoc.strip_tabs {
                    let tabs = line.iter().take_while(|&&c| c == '\t').count();
                    &line[tabs..]
                } else {
                    line
                };
                if trimmed.iter().copied().eq(heredoc.delimiter.chars()) {
                    break;
                }
                let continued = line.iter().rev().take_while(|&&c| c == '\\').count() % 2 == 1;
                if !heredoc.quoted && (continued || line.iter().any(|&c| c == '$' || c == '`')) {
                    return None;
                }
            }
        }
        Some(())
    }

    fn nested(&mut self, f: impl FnOnce(&mut Self) -> Option<()>) -> Option<()> {
        if self.depth >= MAX_SHELL_NESTING {
            return None;
        }
        self.depth += 1;
        let res = f(self);
        self.depth -= 1;
        res
    }

    /// Copies an escape or a quoted string into `out` as written, splitting any commands
    /// substituted inside it.
    fn quoted(&mut self, out: &mut String) -> Option<()> {
        match self.peek(0)? {
            '\\' => {
                out.push('\\');
                self.pos += 1;
                if let Some(next) = self.peek(0) {
                    out.push(next);
                    self.pos += 1;
                }
            }
            '$' if self.peek(1) == Some('\'') => {
                // ANSI-C quoting, `$'…'`: unlike plain single quotes, `\'` escapes a quote.
                out.push_str("$'");
                self.pos += 2;
                loop {
                    match self.peek(0)? {
                        '\\' => {
                            out.push('\\');
                            out.push(self.peek(1)?);
                            self.pos += 2;
                        }
                        '\'' => {
                            out.push('\'');
                            self.pos += 1;
                            break;
                        }
                        ch => {
                            out.push(ch);
                            self.pos += 1;
                        }
                    }
                }
            }
            '\'' => {
                // Nothing is special inside single quotes, not even `\`.
                let close = self.chars[self.pos + 1..].iter().position(|&c| c == '\'')?;
                let end = self.pos + 1 + close;
                out.extend(&self.chars[self.pos..=end]);
                self.pos = end + 1;
            }
            '"' => {
                out.push('"');
                self.pos += 1;
                loop {
                    match self.peek(0)? {
                        '"' => {
                            out.push('"');
                            self.pos += 1;
                            break;
                        }
                        '\\' => self.quoted(out)?,
                        '`' => self.backticks(out, true)?,
                        '$' if self.peek(1) == Some('(') => self.substitution(out)?,
                        '$' if self.peek(1) == Some('{') => self.parameter(out, true)?,
                        ch => {
                            out.push(ch);
                            self.pos += 1;
                        }
                    }
                }
            }
            ch => {
                out.push(ch);
                self.pos += 1;
            }
        }
        Some(())
    }

    /// A backtick substitution, copied into `out` as written. Before running the command
    /// inside, the shell removes the backslash from `\$`, `` \` `` and `\\` (and, within
    /// double quotes, from `\"`), which is how backticks nest: `` echo `a \`b\`` `` runs `b`
    /// too. So the command is split from that unescaped text, not from the text as written.
    fn backticks(&mut self, out: &mut String, in_double_quotes: bool) -> Option<()> {
        let start = self.pos;
        let mut end = start + 1;
        loop {
            match self.chars.get(end)? {
                '\\' => end += 2,
                '`' => break,
                _ => end += 1,
            }
        }
        if self.depth >= MAX_SHELL_NESTING {
            return None;
        }
        let inner = unescape_backticks(&self.chars[start + 1..end], in_double_quotes);
        let mut inner_splitter = Splitter {
            chars: &inner,
            pos: 0,
            depth: self.depth + 1,
            segments: Vec::new(),
            heredocs: Vec::new(),
        };
        inner_splitter.list(false)?;
        self.segments.extend(inner_splitter.segments);
        out.extend(&self.chars[start..=end]);
        self.pos = end + 1;
        Some(())
    }

    /// `$(…)`, `<(…)` or `>(…)`: the inner commands become pieces, and the text stays in `out`.
    /// Bash parses a substitution on its own: here-documents opened before it wait for the
    /// end of the enclosing line, not for a newline inside it, and those opened inside it must
    /// end inside it.
    fn substitution(&mut self, out: &mut String) -> Option<()> {
        let start = self.pos;
        self.pos += 2;
        let outer = std::mem::take(&mut self.heredocs);
        self.nested(|splitter| splitter.list(true))?;
        if !self.heredocs.is_empty() {
            return None;
        }
        self.heredocs = outer;
        out.extend(&self.chars[start..self.pos]);
        Some(())
    }

    /// `${…}`, copied into `out` up to its matching `}`, splitting any commands substituted
    /// inside it. The shell reads all of it as part of one word: blanks, `#`, `;` and `|`
    /// stand for themselves there, while quotes, escapes and substitutions nest. Within
    /// double quotes bash reads a quote inside `${…}` as a quote for some operators and not
    /// others, and shells differ, so there a quote makes the command unparseable rather than
    /// guessed at.
    fn parameter(&mut self, out: &mut String, in_double_quotes: bool) -> Option<()> {
        out.push_str("${");
        self.pos += 2;
        self.nested(|splitter| {
            loop {
                match splitter.peek(0)? {
                    '}' => {
                        out.push('}');
                        splitter.pos += 1;
                        return Some(());
                    }
                    '\'' | '"' if in_double_quotes => return None,
                    '\\' | '\'' | '"' => splitter.quoted(out)?,
                    '`' => splitter.backticks(out, in_double_quotes)?,
                    '$' if splitter.peek(1) == Some('\'') => splitter.quoted(out)?,
                    '$' if splitter.peek(1) == Some('(') => splitter.substitution(out)?,
                    '$' if splitter.peek(1) == Some('{') => {
                        splitter.parameter(out, in_double_quotes)?
                    }
                    ch => {
                        out.push(ch);
                        splitter.pos += 1;
                    }
                }
            }
        })
    }

    /// At digits that open a redirection, as in `2>err.log` or `2>&1`.
    fn fd_redirect(&self) -> bool {
        let mut offset = 0;
        while self.peek(offset).is_some_and(|c| c.is_ascii_digit()) {
            offset += 1;
        }
        matches!(self.peek(offset), Some('<' | '>'))
    }

    /// A redirection: dropped when it touches no file, else pushed as a piece of its own.
    fn redirect(&mut self, current: &str) -> Option<()> {
        let mut op = String::new();
        while let Some(digit) = self.peek(0).filter(char::is_ascii_digit) {
            op.push(digit);
            self.pos += 1;
        }
        const OPERATORS: [&str; 12] = [
            "&>>", "&>", ">>", ">|", ">&", "<<<", "<<-", "<<", "<>", "<&", ">", "<",
        ];
        let operator = OPERATORS.into_iter().find(|op| self.starts_with(op))?;
        op.push_str(operator);
        self.pos += operator.chars().count();
        self.skip_blanks();
        let target = self.word()?;
        if target.is_empty() {
            return None;
        }
        if matches!(operator, "<<" | "<<-") {
            // The body starts after the next newline; `heredoc_bodies` skips it there.
            self.heredocs.push(Heredoc {
                delimiter: heredoc_delimiter(&target)?,
                strip_tabs: operator == "<<-",
                quoted: target.contains(['\'', '"', '\\']),
            });
        }
        let harmless = match operator {
            // Here-documents and here-strings feed text to stdin; no file is involved.
            "<<" | "<<-" | "<<<" => true,
            // `2>&1`, `>&-`: duplicating or closing a descriptor. `>&file` writes a file.
            ">&" | "<&" => {
                let digits = target.strip_suffix('-').unwrap_or(&target);
                digits.chars().all(|c| c.is_ascii_digit())
            }
            _ => target == "/dev/null",
        };
        if !harmless {
            self.segments.push(format!("{op} {target}"));
        }
        if at_word_start(current) {
            self.skip_blanks();
        }
        Some(())
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(0), Some(' ' | '\t')) {
            self.pos += 1;
        }
    }

    /// One shell word as written, quotes included, up to an unquoted blank or operator.
    fn word(&mut self) -> Option<String> {
        let mut word = String::new();
        while let Some(ch) = self.peek(0) {
            match ch {
                ' ' | '\t' | '\n' | ';' | '&' | '|' | '(' | ')' | '<' | '>' => break,
                '\\' | '\'' | '"' => self.quoted(&mut word)?,
                '`' => self.backticks(&mut word, false)?,
                '$' if self.peek(1) == Some('\'') => self.quoted(&mut word)?,
                '$' if self.peek(1) == Some('(') => self.substitution(&mut word)?,
                '$' if self.peek(1) == Some('{') => self.parameter(&mut word, false)?,
                _ => {
                    word.push(ch);
                    self.pos += 1;
                }
            }
        }
        Some(word)
    }
}

/// The command inside backticks as the shell runs it: `\$`, `` \` `` and `\\` (and, within
/// double quotes, `\"`) lose their backslash, and any other backslash stays.
fn unescape_backticks(raw: &[char], in_double_quotes: bool) -> Vec<char> {
    let mut inner = Vec::with_capacity(raw.len());
    let mut chars = raw.iter().copied();
    while let Some(ch) = chars.next() {
        if ch == '\\'
            && let Some(next) = chars.next()
        {
            if !(matches!(next, '$' | '`' | '\\') || (in_double_quotes && next == '"')) {
                inner.push('\\');
            }
            inner.push(next);
        } else {
            inner.push(ch);
        }
    }
    inner
}

/// The line that ends a here-document opened with `word`: the word after quote removal,
/// which is what the shell compares body lines with (`'E"OF'` ends at `E"OF`, `"E\OF"` at
/// `E\OF`). `None` for words whose quote removal we do not follow (`$'…'`, `$"…"`,
/// substitutions, line continuations): a body skipped up to the wrong line would hide the
/// commands after the real one.
fn heredoc_delimiter(word: &str) -> Option<String> {
    let mut delimiter = String::new();
    let mut chars = word.chars().peekable();
    while let Some(ch) = chars.next() {
        match ch {
            '\\' => match chars.next()? {
                '\n' => return None,
                escaped => delimiter.push(escaped),
            },
            '\'' => loop {
                match chars.next()? {
                    '\'' => break,
                    inner => delimiter.push(inner),
                }
            },
            '"' => loop {
                match chars.next()? {
                    '"' => break,
                    // Within double quotes a backslash only escapes these; before anything
                    // else it is kept.
                    '\\' => {
                        let escaped = chars.next()?;
                        match escaped {
                            '\n' => return None,
                            '$' | '`' | '"' | '\\' => {}
                            _ => delimiter.push('\\'),
                        }
                        delimiter.push(escaped);
                    }
                    '$' | '`' => return None,
                    inner => delimiter.push(inner),
                }
            },
            '`' => return None,
            '$' if matches!(chars.peek(), Some('\'' | '"' | '(' | '{')) => return None,
            _ => delimiter.push(ch),
        }
    }
    Some(delimiter)
}

/// Whether the next character starts a word, where `#` opens a comment and digits can name
/// a descriptor. `current` is the command as written so far, so an escaped blank (`\ `) is
/// part of a word rather than the end of one, and line continuations (`\` newline) are looked
/// through: the shell removes them before it splits words, so in `echo \<newline>#` the `#`
/// still opens a comment. Getting either wrong lets a comment hide, or uncover, an operator.
fn at_word_start(current: &str) -> bool {
    let mut rest = current;
    while let Some(before) = rest.strip_suffix('\n')
        && let Some(before) = before.strip_suffix('\\')
        && !ends_in_escape(before)
    {
        rest = before;
    }
    match rest.strip_suffix([' ', '\t']) {
        Some(before) => !ends_in_escape(before),
        None => rest.is_empty(),
    }
}

/// Whether `text` ends in an odd number of backslashes, the last of which escapes whatever
/// follows.
fn ends_in_escape(text: &str) -> bool {
    text.chars().rev().take_while(|&c| c == '\\').count() % 2 == 1
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use serde_json::json;

    use super::*;
    use crate::permissions::{Action, Mode, Policy, Rule, RuleSource};

    fn split(command: &str) -> Vec<String> {
        split_command(command).expect("parses")
    }

    #[test]
    fn splitting_commands() {
        let split = |command: &str| split_command(command).expect("parses");
        assert_eq!(split("git status"), ["git status"]);
        assert_eq!(split("git status && rm -rf /"), ["git status", "rm -rf /"]);
        assert_eq!(
            split("a; b || c | d & e\nf |& g"),
            ["a", "b", "c", "d", "e", "f", "g"]
        );
        assert_eq!(
            split("echo 'a && b' \"c; d\" e\\;f"),
            ["echo 'a && b' \"c; d\" e\\;f"]
        );
        assert_eq!(split("echo $(rm -rf /)"), ["rm -rf /", "echo $(rm -rf /)"]);
        assert_eq!(split("echo \"$(a; b)\""), ["a", "b", "echo \"$(a; b)\""]);
        assert_eq!(split("echo `whoami`"), ["whoami", "echo `whoami`"]);
        assert_eq!(split("diff <(ls a) b"), ["ls a", "diff <(ls a) b"]);
        assert_eq!(split("(cd x && make)"), ["cd x", "make"]);
        assert_eq!(split("cargo test 2>&1 | tail"), ["cargo test", "tail"]);
        assert_eq!(split("cargo test >/dev/null 2>&1"), ["cargo test"]);
        assert_eq!(split("git log > out.txt"), ["> out.txt", "git log"]);
        assert_eq!(
            split("sort < in.txt >> out.txt"),
            ["< in.txt", ">> out.txt", "sort"]
        );
        assert_eq!(split("make 2> err.log all"), ["2> err.log", "make all"]);
        assert_eq!(split("cmd &> log"), ["&> log", "cmd"]);
        assert_eq!(split("cmd >&file"), [">& file", "cmd"]);
        assert_eq!(split("cat <<< hi"), ["cat"]);
        assert_eq!(split("git status # it's fine; rm"), ["git status"]);
        assert_eq!(split("ls # '\nrm -rf /\n# '"), ["ls", "rm -rf /"]);
        assert_eq!(split("echo a#b"), ["echo a#b"]);
        assert_eq!(
            split("echo $'\\'' ; rm -rf / ; echo $'\\''"),
            ["echo $'\\''", "rm -rf /", "echo $'\\''"]
        );
        assert_eq!(
            split("cat <<EOF > f.txt\nit's; body\nEOF\nrm x"),
            ["> f.txt", "cat", "rm x"]
        );
        assert_eq!(
            split("git commit -m \"$(cat <<'EOF'\nfix: it's $(not run)\nEOF\n)\" && git log"),
            [
                "cat",
                "git commit -m \"$(cat <<'EOF'\nfix: it's $(not run)\nEOF\n)\"",
                "git log"
            ]
        );
        assert_eq!(split("cat <<-EOF\n\tbody\n\tEOF\nls"), ["cat", "ls"]);
        assert_eq!(split("echo a2>b"), ["> b", "echo a2"]);
        assert_eq!(split("  "), Vec::<String>::new());
        for broken in [
            "echo 'open",
            "echo \"open",
            "echo $(open",
            "a )",
            "echo `x",
            "cat >",
            "x > ;",
            "echo $'open\\'",
            "cat <<EOF\nno end",
            "cat <<EOF",
            "cat <<EOF\n$(rm -rf /)\nEOF",
        ] {
            assert_eq!(split_command(broken), None, "{broken}");
        }
        assert_eq!(split("\\; \\a"), ["\\; \\a"]);
        let deep = format!("{}x{}", "$(".repeat(40), ")".repeat(40));
        assert_eq!(split_command(&deep), None);
    }

    /// Whether `Bash(<prefix>:*)` rules for `prefixes` allow `command`.
    fn prefixes_allow(prefixes: &[&str], command: &str) -> bool {
        let rules = prefixes
            .iter()
            .map(|prefix| {
                Rule::new(
                    &format!("Bash({prefix}:*)"),
                    Action::Allow,
                    None,
                    RuleSource::Project,
                )
                .expect("test pattern is valid")
            })
            .collect();
        let policy = Policy::new(rules, Mode::Default, PathBuf::from("/w"));
        policy.decide("Bash", &json!({ "command": command })).action == Action::Allow
    }

    #[test]
    fn here_documents_wait_for_the_end_of_their_own_line() {
        // Bash reads this body after the newline that ends the `cat` line, not after the one
        // inside `$(…)`, so `touch` runs in the substitution.
        for (open, close) in [("$(", ")"), ("<(", ")"), ("${x:-$(", ")}")] {
            let command =
                format!("cat <<echo && echo {open}\ntouch /tmp/pwned\necho\n{close}\necho");
            let outer = format!("echo {open}\ntouch /tmp/pwned\necho\n{close}");
            assert_eq!(split(&command), ["cat", "touch /tmp/pwned", "echo", &outer]);
            assert!(!prefixes_allow(&["cat", "echo"], &command), "{command}");
        }
        // A here-document opened inside a substitution ends inside it.
        assert_eq!(
            split("echo $(cat <<EOF\nbody\nEOF\n)"),
            ["cat", "echo $(cat <<EOF\nbody\nEOF\n)"]
        );
        assert_eq!(split_command("echo $(cat <<EOF)\nbody\nEOF"), None);
        // A subshell is parsed with its surroundings, so there the first newline does start
        // the body.
        assert_eq!(split("cat <<EOF && (\nbody\nEOF\nls)"), ["cat", "ls"]);
    }

    #[test]
    fn backticks_are_split_as_the_shell_unescapes_them() {
        // Bash turns `\`` inside backticks into a backtick and runs that substitution too.
        let nested = "echo `echo \\`touch /tmp/pwned\\``";
        assert_eq!(
            split(nested),
            ["touch /tmp/pwned", "echo `touch /tmp/pwned`", nested]
        );
        assert!(!prefixes_allow(&["echo"], nested));
        // Within double quotes `\"` loses its backslash as well: these are real quotes, and
        // the `'` between them is quoted text rather than a string hiding the `;`.
        let quoted = "echo \"`echo \\\"'\\\"; touch /tmp/pwned; echo \\\"'\\\"`\"";
        assert_eq!(
            split(quoted),
            ["echo \"'\"", "touch /tmp/pwned", "echo \"'\"", quoted]
        );
        assert!(!prefixes_allow(&["echo"], quoted));
        // Any other backslash stays.
        assert_eq!(
            split("echo `printf \\a\\\\$x`"),
            ["printf \\a\\$x", "echo `printf \\a\\\\$x`"]
        );
    }

    #[test]
    fn unquoted_here_document_lines_ending_in_a_backslash_are_refused() {
        // Bash joins `E\` and `OF` into the delimiter line, ends the body and runs `touch`.
        let joined = "cat <<EOF\nE\\\nOF\ntouch /tmp/pwned\nEOF";
        assert_eq!(split_command(joined), None);
        assert!(!prefixes_allow(&["cat"], joined));
        // An escaped backslash joins nothing, and neither does a quoted delimiter's body.
        assert_eq!(split("cat <<EOF\na\\\\\nEOF"), ["cat"]);
        assert_eq!(split("cat <<'EOF'\nE\\\nOF\nEOF"), ["cat"]);
    }

    #[test]
    fn here_document_delimiters_are_unquoted_as_the_shell_does() {
        // Bash ends each body at its first line and runs `touch`; removing every quote and
        // backslash from the word made the splitter wait for `EOF` and skip `touch` as body.
        for command in [
            "cat <<'E\"OF'\nE\"OF\ntouch /tmp/pwned\nEOF",
            "cat <<\"E\\\"OF\"\nE\"OF\ntouch /tmp/pwned\nEOF",
            "cat <<\"E\\OF\"\nE\\OF\ntouch /tmp/pwned\nEOF",
            "cat <<E\\\\OF\nE\\OF\ntouch /tmp/pwned\nEOF",
        ] {
            assert_eq!(
                split(command),
                ["cat", "touch /tmp/pwned", "EOF"],
                "{command}"
            );
            assert!(!prefixes_allow(&["cat"], command), "{command}");
        }
        assert_eq!(split("cat <<E'O'F\n$(body)\nEOF\nls"), ["cat", "ls"]);
        assert_eq!(split("cat <<\\EOF\n$(body)\nEOF"), ["cat"]);
        // Quote removal we do not follow: refuse rather than guess where the body ends.
        assert_eq!(
            split_command("cat <<$'EOF'\nEOF\ntouch /tmp/pwned\n$EOF"),
            None
        );
        assert_eq!(split_command("cat <<`x`\nbody\n`x`"), None);
    }

    #[test]
    fn parameter_expansions_are_read_to_their_closing_brace() {
        // Inside `${…}` a blank and `#` are text, not the start of a comment hiding the `;`.
        let hidden = "echo ${x:- #}; touch /tmp/pwned";
        assert_eq!(split(hidden), ["echo ${x:- #}", "touch /tmp/pwned"]);
        assert!(!prefixes_allow(&["echo"], hidden));
        // Separators and parentheses inside it are text too, as bash reads them.
        assert_eq!(split("echo ${x:-a;b|c (d)}"), ["echo ${x:-a;b|c (d)}"]);
        assert_eq!(
            split("echo ${x:-'}'} ${#x} ${x#*/} \"${x:-a\\\"}\""),
            ["echo ${x:-'}'} ${#x} ${x#*/} \"${x:-a\\\"}\""]
        );
        // Commands substituted inside it are still pieces.
        assert_eq!(
            split("echo \"${x:-$(rm -rf /)}\""),
            ["rm -rf /", "echo \"${x:-$(rm -rf /)}\""]
        );
        // Bash takes the `'` inside `"${…}"` for a quote, so the `"` after it does not close
        // the string and the `;` runs a second command; such commands are unparseable.
        let quoted = "echo \"${x/'\"'/}\"; touch /tmp/pwned; echo ' #'";
        assert_eq!(split_command(quoted), None);
        assert!(!prefixes_allow(&["echo"], quoted));
        assert_eq!(split_command("echo \"${x:-\"a\"}\""), None);
        assert_eq!(split_command("echo ${x:-a"), None);
    }

    #[test]
    fn escaped_blanks_and_line_continuations_place_comments_as_the_shell_does() {
        // Bash reads `\ #` as a word holding a blank and a `#`, not a comment, so the `;`
        // after it separates a second command.
        let escaped = "echo \\ #; touch /tmp/pwned";
        assert_eq!(split(escaped), ["echo \\ #", "touch /tmp/pwned"]);
        assert!(!prefixes_allow(&["echo"], escaped));
        assert_eq!(split("echo \\\t#; b"), ["echo \\\t#", "b"]);
        // Bash removes `\` newline before splitting words, so this `#` does open a comment,
        // and the quote inside it must not hide the next line.
        let continued = "echo \\\n# '\ntouch /tmp/pwned\n# '";
        assert_eq!(split(continued), ["echo \\", "touch /tmp/pwned"]);
        assert!(!prefixes_allow(&["echo"], continued));
        // ...but a continuation inside a word joins the `#` to it.
        assert_eq!(split("echo a\\\n#; b"), ["echo a\\\n#", "b"]);
        // An escaped backslash before the blank leaves the blank unescaped.
        assert_eq!(split("echo a\\\\ # ; b"), ["echo a\\\\"]);
    }
}
