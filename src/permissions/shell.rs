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
/// (`2>&1`, `>/dev/null`, here-documents) are dropped, and so are here-document bodies,
/// which are data. Returns `None` when the quoting or nesting does not balance, or when the
/// command holds something shells read differently or this splitter does not follow (quotes
/// inside `"${…}"`, bodies that expand, unusual delimiter words); callers then let no allow
/// rule match.
///
/// This is a conservative reading of bash, not a shell: where it cannot read what bash reads
/// it gives up or reads extra pieces (`[[ a && b ]]` gives two), which can only make an allow
/// rule less likely to match. It must never read fewer commands than bash runs.
pub(crate) fn split_command(command: &str) -> Option<Vec<String>> {
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

#[cfg(test)]
mod noise {
    //! Noise tests: thousands of commands from a seeded pseudo-random generator, checked
    //! against what callers of the splitter rely on. The seeds are fixed, so a failure names
    //! a command that fails the same way on every run.
    //!
    //! Two generators. `soup` glues fragments of shell syntax together with no regard for
    //! balance, to shake out panics, hangs and blow-ups on hostile input. `Model` writes
    //! well-formed commands while keeping track of what the shell will run, so each comes
    //! with the exact pieces a correct splitter returns; this is what catches a splitter that
    //! reads quoting, comments or nesting differently from the shell.

    use std::path::PathBuf;
    use std::sync::mpsc::{self, RecvTimeoutError};
    use std::time::Duration;

    use serde_json::json;

    use super::{MAX_SHELL_NESTING, split_command};
    use crate::permissions::{Action, Mode, Policy, Rule, RuleSource};

    /// Each test runs its generator once per seed.
    const SEEDS: [u64; 4] = [1, 0x5eed, 0xdead_beef, 20_240_601];

    /// Commands generated per seed by `soup`, which are short and cheap to check.
    const SOUP_CASES: usize = 2_500;

    /// Commands generated per seed by `Model`; longer, and each piece is split again.
    const MODEL_CASES: usize = 1_500;

    /// Commands per seed that get something appended, each judged by a whole policy.
    const SMUGGLING_CASES: usize = 1_000;

    /// How many of `SMUGGLED` each of those commands gets, in turn.
    const SMUGGLED_PER_CASE: usize = 3;

    /// How long one test may run before a stuck splitter counts as a hang; far above the
    /// second or two the tests need in a debug build.
    const DEADLINE: Duration = Duration::from_secs(120);

    /// Deepest nesting of lists the model writes, well inside `MAX_SHELL_NESTING` so that
    /// the depth cap never decides a model command.
    const MODEL_DEPTH: usize = 3;

    /// Commands that the rules in `HEAD_RULES` allow, with any arguments.
    const HEADS: [&str; 4] = ["echo", "git status", "ls", "cat"];
    const HEAD_RULES: [&str; 4] = [
        "Bash(echo:*)",
        "Bash(git status:*)",
        "Bash(ls:*)",
        "Bash(cat:*)",
    ];

    /// A command no rule allows, which the model now and then writes in place of one of
    /// `HEADS`.
    const PLANTED: &str = "rm -rf /";

    /// What an attacker appends to an allowed command to get another one run.
    const SMUGGLED: [&str; 10] = [
        "&& rm -rf /",
        "; curl x | sh",
        "| sh",
        "|| rm -rf /",
        "& rm -rf /",
        "\nrm -rf /",
        "$(rm -rf /)",
        "`rm -rf /`",
        "<(rm -rf /)",
        "> ~/.bashrc",
    ];

    /// Fragments of shell syntax for `soup`, many of them unbalanced on purpose.
    const FRAGMENTS: &[&str] = &[
        "echo", "ls", "x", "a b", "-la", "42", "2", "é", "日本", "🦀", "\u{0}", " ", "  ", "\t",
        "\n", "\r\n", "'", "\"", "`", "\\", "\\\n", "\\ ", "$", "$'", "$\"", "$(", "$((", "(", ")",
        "${", "}", "{", "<(", ">(", "&&", "||", "&", "|", "|&", ";", ";;", "#", " #", "# '", "!",
        ">", ">>", "<", "2>", "2>&1", ">&", "&>", ">|", "<>", "<<<", "<<", "<<-", "EOF", "'EOF'",
        "E\"OF", "'a; b'", "`id`", "$'\\''", "\\;", "*", "?", "[", "]", "~", "=", "FOO=1 ",
    ];

    /// Longer fragments for `soup`: whole commands, quoted operators, delimiter lines.
    const PHRASES: &[&str] = &[
        "git status",
        "/dev/null",
        "\"a && b\"",
        "$(rm -rf /)",
        "\\`id\\`",
        "\nEOF\n",
        "\n\tEOF\n",
    ];

    /// Characters of unquoted words; `#` starts a comment at the start of a word.
    const PLAIN: &[char] = &[
        'a', 'b', 'x', 'z', '0', '1', '9', '_', '-', '.', '/', ':', '+', ',', '@', '%', '^', '*',
        '?', '[', ']', '~', '!', '=', '{', '}', '#', 'é', '日', '🦀',
    ];
    /// Characters inside single quotes, where nothing is special.
    const SINGLE: &[char] = &[
        ' ', ';', '&', '|', '"', '`', '$', '(', ')', '\\', '\n', '#', '<', '>', 'a', 'é', '{', '}',
        '*',
    ];
    /// Characters that stand for themselves inside double quotes.
    const DOUBLE: &[char] = &[
        'a', ' ', '\t', '\n', '\'', ';', '&', '|', '(', ')', '#', '<', '>', '{', '}', '日', '*',
        '~', '!',
    ];
    /// What follows a backslash inside double quotes.
    const DOUBLE_ESCAPED: &[char] = &['"', '\\', '$', '`', 'a', '\n', '\''];
    /// What follows a backslash outside quotes; `\` newline is a line continuation.
    const ESCAPED: &[char] = &[
        ' ', '\t', ';', '&', '|', '#', '\'', '"', '`', '$', '(', ')', '<', '>', '\\', 'a', 'é',
        '\n', '{', '}', '*',
    ];
    /// Characters inside `$'…'` besides its escapes.
    const ANSI: &[char] = &[' ', ';', '&', '|', '"', '`', '$', '(', ')', '#', 'a', '\n'];
    /// Characters that stand for themselves inside `${…}`, blanks and operators included.
    const PARAM: &[char] = &[
        ' ', ';', '&', '|', '#', '<', '>', '(', ')', 'a', '/', '*', '\n', '日', '!', '?', ',', '.',
        ':', '-', '=', '+', '@', '%', '^', '[', ']', '~', '0',
    ];
    /// Characters of comments, which run to the end of the line.
    const COMMENT: &[char] = &[
        '\'', '"', '`', ';', '&', '|', '$', '(', ')', '\\', '#', ' ', 'a', '{', '}',
    ];
    /// Characters of here-document bodies; `$` and backticks are added separately.
    const BODY: &[char] = &[
        ' ', 'a', 'z', ';', '&', '|', '\'', '"', '(', ')', '#', '<', '>', '\\', '\t', '日',
    ];

    /// Here-document delimiter words: as written, the line that ends the body (`None` when
    /// the splitter must refuse the word), and a line that a careless quote removal would
    /// take for the end while the shell reads on.
    const DELIMITERS: &[(&str, Option<&str>, Option<&str>)] = &[
        ("EOF", Some("EOF"), None),
        ("'EOF'", Some("EOF"), None),
        ("\"EOF\"", Some("EOF"), None),
        ("\\EOF", Some("EOF"), None),
        ("E'O'F", Some("EOF"), None),
        ("'E\"OF'", Some("E\"OF"), Some("EOF")),
        ("\"E\\\"OF\"", Some("E\"OF"), Some("EOF")),
        ("\"E\\OF\"", Some("E\\OF"), Some("EOF")),
        ("E\\\\OF", Some("E\\OF"), Some("EOF")),
        ("\"E'OF\"", Some("E'OF"), Some("EOF")),
        ("$'EOF'", None, None),
        ("$\"EOF\"", None, None),
    ];

    /// xorshift64*: deterministic, and random enough to pick fragments.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Rng {
            // The state must never be zero; spreading the seed also decorrelates small seeds.
            Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        /// A number in `0..n`.
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }

        fn percent(&mut self, chance: u64) -> bool {
            self.next() % 100 < chance
        }

        fn pick<T: Copy>(&mut self, items: &[T]) -> T {
            items[self.below(items.len())]
        }

        /// Up to `max` characters drawn from `alphabet`.
        fn text(&mut self, alphabet: &[char], max: usize) -> String {
            (0..self.below(max + 1))
                .map(|_| self.pick(alphabet))
                .collect()
        }
    }

    /// Runs `check` on its own thread, so that a splitter stuck in a loop fails the test
    /// instead of hanging the whole run.
    fn within_deadline(check: impl FnOnce() + Send + 'static) {
        let (done, finished) = mpsc::channel();
        let worker = std::thread::spawn(move || {
            check();
            let _ = done.send(());
        });
        match finished.recv_timeout(DEADLINE) {
            Ok(()) => {}
            // `check` panicked, dropping the sender: pass the panic on.
            Err(RecvTimeoutError::Disconnected) => {
                if let Err(panic) = worker.join() {
                    std::panic::resume_unwind(panic);
                }
            }
            Err(RecvTimeoutError::Timeout) => {
                panic!("the splitter did not finish within {DEADLINE:?}")
            }
        }
    }

    /// Up to 40 fragments in a row, now and then wrapped in nesting deeper than the splitter
    /// follows.
    fn soup(rng: &mut Rng) -> String {
        let count = rng.below(40) + 1;
        let mut command: String = (0..count)
            .map(|_| {
                if rng.percent(10) {
                    rng.pick(PHRASES)
                } else {
                    rng.pick(FRAGMENTS)
                }
            })
            .collect();
        if rng.percent(5) {
            let (open, close) = rng.pick(&[
                ("$(", ")"),
                ("(", ")"),
                ("\"$(", ")\""),
                ("<(", ")"),
                ("${x:-", "}"),
                ("\"${x:-", "}\""),
            ]);
            let depth = rng.below(2 * MAX_SHELL_NESTING + 2);
            command = format!("{}{command}{}", open.repeat(depth), close.repeat(depth));
        }
        command
    }

    fn is_subsequence(part: &str, whole: &str) -> bool {
        let mut rest = whole.chars();
        part.chars().all(|ch| rest.any(|c| c == ch))
    }

    /// What holds for every command, however malformed: the splitter returns, and what it
    /// returns is bounded by the input, made of the input, and read the same way again.
    fn check_pieces(command: &str, what: &str) {
        let Some(pieces) = split_command(command) else {
            return;
        };
        let chars = command.chars().count();
        let total: usize = pieces.iter().map(|piece| piece.chars().count()).sum();
        // Every piece holds a character of its own (a command word, an operator, a quote).
        assert!(
            pieces.len() <= chars,
            "{what}: {} pieces from {chars} characters in {command:?}",
            pieces.len()
        );
        // A character is copied once for each substitution around it, at most one per
        // nesting level, and a file redirection gains a space after its operator.
        assert!(
            total <= (MAX_SHELL_NESTING + 1) * chars + pieces.len(),
            "{what}: {total} characters of pieces from {chars} in {command:?}"
        );
        for piece in &pieces {
            assert!(!piece.is_empty(), "{what}: an empty piece from {command:?}");
            // Pieces are the command's own characters in order, except for the space a file
            // redirection gains after its operator.
            assert!(
                is_subsequence(&piece.replacen(' ', "", 1), command),
                "{what}: piece {piece:?} is not made of {command:?}"
            );
            // A here-document opened inside `$(…)` can have its body after the piece that
            // holds it, so that piece alone leaves the document open.
            if piece.contains("<<") {
                continue;
            }
            // Split again, a piece is still one command: itself, after the commands
            // substituted inside it, all of which were pieces already. A piece that splits
            // further would be a chained command an allow rule could wave through whole.
            let again = split_command(piece);
            assert!(
                again
                    .as_ref()
                    .is_some_and(|again| again.last() == Some(piece)
                        && again.iter().all(|inner| pieces.contains(inner))),
                "{what}: piece {piece:?} of {command:?} splits again as {again:?}"
            );
        }
    }

    fn head_policy() -> Policy {
        let rules = HEAD_RULES
            .iter()
            .map(|pattern| {
                Rule::new(pattern, Action::Allow, None, RuleSource::Project)
                    .expect("test pattern is valid")
            })
            .collect();
        Policy::new(rules, Mode::Default, PathBuf::from("/w"))
    }

    fn allowed(policy: &Policy, command: &str) -> bool {
        policy.decide("Bash", &json!({ "command": command })).action == Action::Allow
    }

    /// Appends some of `SMUGGLED` to `command`, starting at `first`. Whatever `command` is,
    /// the appended command runs unless something before it is left open (then the splitter
    /// gives up, which asks) or a comment hides it, so no prefix rule may allow the result.
    fn check_smuggling(
        policy: &Policy,
        command: &str,
        first: usize,
        comments_may_hide: bool,
        what: &str,
    ) {
        for offset in 0..SMUGGLED_PER_CASE {
            let smuggled = SMUGGLED[(first + offset) % SMUGGLED.len()];
            if comments_may_hide && command.contains('#') && !smuggled.starts_with('\n') {
                continue;
            }
            let attack = format!("{command} {smuggled}");
            assert!(
                !allowed(policy, &attack),
                "{what}: {attack:?} is allowed by {HEAD_RULES:?}"
            );
        }
    }

    #[test]
    fn noise_never_breaks_the_splitter() {
        within_deadline(|| {
            for seed in SEEDS {
                let mut rng = Rng::new(seed);
                for case in 0..SOUP_CASES {
                    let command = soup(&mut rng);
                    check_pieces(&command, &format!("seed {seed} case {case}"));
                }
            }
        });
    }

    #[test]
    fn well_formed_commands_split_as_the_shell_reads_them() {
        within_deadline(|| {
            for seed in SEEDS {
                let mut rng = Rng::new(seed);
                let mut refused = 0;
                for case in 0..MODEL_CASES {
                    let (command, expected) = Model::generate(&mut rng, false);
                    let what = format!("seed {seed} case {case}");
                    assert_eq!(split_command(&command), expected, "{what}: {command:?}");
                    check_pieces(&command, &what);
                    refused += usize::from(expected.is_none());
                }
                // The model must mostly write commands the splitter reads, or the exact
                // comparison above would test little.
                assert!(
                    refused < MODEL_CASES / 4,
                    "seed {seed}: {refused} of {MODEL_CASES} commands refused"
                );
            }
        });
    }

    #[test]
    fn smuggled_commands_are_never_allowed() {
        within_deadline(|| {
            let policy = head_policy();
            for seed in SEEDS {
                let mut rng = Rng::new(seed);
                let mut covered = 0;
                let mut planted = 0;
                for case in 0..SMUGGLING_CASES {
                    let what = format!("seed {seed} case {case}");
                    let (command, from_model) = if case % 2 == 0 {
                        let (command, pieces) = Model::generate(&mut rng, true);
                        // Wherever the model planted a command, the shell runs it, so no rule
                        // may allow the whole: this is where a misread quote or comment
                        // would hide it.
                        if pieces.is_some_and(|pieces| {
                            pieces.iter().any(|piece| piece.starts_with(PLANTED))
                        }) {
                            planted += 1;
                            assert!(
                                !allowed(&policy, &command),
                                "{what}: {command:?} runs {PLANTED:?} yet is allowed"
                            );
                        }
                        (command, true)
                    } else {
                        let head = rng.pick(&HEADS);
                        (format!("{head} {}", soup(&mut rng)), false)
                    };
                    covered += usize::from(allowed(&policy, &command));
                    // Soup can end in a comment, which hides what follows from the shell too;
                    // the model ends every comment with a newline.
                    let first = case * SMUGGLED_PER_CASE;
                    check_smuggling(&policy, &command, first, !from_model, &what);
                }
                // Checks that never ran prove nothing: enough commands must plant one, and
                // enough must be allowed before anything is appended.
                assert!(
                    planted > SMUGGLING_CASES / 20,
                    "seed {seed}: only {planted} of {SMUGGLING_CASES} commands planted one"
                );
                assert!(
                    covered > SMUGGLING_CASES / 4,
                    "seed {seed}: only {covered} of {SMUGGLING_CASES} commands allowed on their own"
                );
            }
        });
    }

    /// A here-document waiting for the end of its line.
    struct Body {
        /// The line that ends it, as the shell compares lines.
        delimiter: &'static str,
        /// `<<-`: leading tabs are stripped from its lines.
        strip_tabs: bool,
        /// The delimiter word was quoted, so the body is taken literally.
        quoted: bool,
        /// A line that ends the body only for a careless reading of the delimiter word.
        decoy: Option<&'static str>,
    }

    /// Writes well-formed commands, and alongside them the pieces the splitter must return,
    /// in the order it finds them: the commands substituted inside a command, and its file
    /// redirections, before the command itself.
    struct Model<'r> {
        rng: &'r mut Rng,
        /// Start every command with one of `HEADS` (or rarely `PLANTED`) and leave out file
        /// redirections, so that `HEAD_RULES` allow the whole command unless it plants one.
        heads: bool,
        /// The command holds something the splitter must refuse to read (`None`).
        refused: bool,
    }

    impl Model<'_> {
        fn generate(rng: &mut Rng, heads: bool) -> (String, Option<Vec<String>>) {
            let mut model = Model {
                rng,
                heads,
                refused: false,
            };
            let mut pieces = Vec::new();
            let command = model.list(0, &mut pieces);
            (command, (!model.refused).then_some(pieces))
        }

        /// Commands joined by separators, as in a substitution: its here-documents are its
        /// own.
        fn list(&mut self, depth: usize, pieces: &mut Vec<String>) -> String {
            self.list_with(depth, pieces, &mut Vec::new())
        }

        /// Commands joined by separators; here-document bodies follow the first newline
        /// after their command, and the list ends after any still owed.
        fn list_with(
            &mut self,
            depth: usize,
            pieces: &mut Vec<String>,
            bodies: &mut Vec<Body>,
        ) -> String {
            const SEPARATORS: [&str; 16] = [
                "; ", ";", " ; ", " && ", "&&", " || ", "||", " | ", "|", " |& ", " & ", "&", "\n",
                " &&\n", ";\n", "\n\n",
            ];
            let mut text = String::new();
            let mut comment = false;
            for index in 0..=self.rng.below(3) {
                if index > 0 {
                    // Only a newline ends a comment.
                    let separator = if comment {
                        "\n"
                    } else {
                        self.rng.pick(&SEPARATORS)
                    };
                    match separator.split_once('\n') {
                        Some((before, after)) => {
                            text.push_str(before);
                            text.push('\n');
                            self.bodies(bodies, &mut text);
                            text.push_str(after);
                        }
                        None => text.push_str(separator),
                    }
                }
                let (command, ends_in_comment) = self.command(depth, pieces, bodies);
                // `&>` and `&&>` would turn a separator and a redirection into one operator.
                if command.starts_with(['<', '>']) && !text.ends_with(char::is_whitespace) {
                    text.push(' ');
                }
                text.push_str(&command);
                comment = ends_in_comment;
            }
            if comment || !bodies.is_empty() {
                text.push('\n');
                self.bodies(bodies, &mut text);
            }
            text
        }

        /// A subshell, or words and redirections with perhaps a comment. Returns the text
        /// and whether it ends in a comment.
        fn command(
            &mut self,
            depth: usize,
            pieces: &mut Vec<String>,
            bodies: &mut Vec<Body>,
        ) -> (String, bool) {
            if depth < MODEL_DEPTH && self.rng.percent(8) {
                // Spaced so that `$( (` never reads as arithmetic `$((`. Unlike a substitution,
                // a subshell is parsed with its surroundings, so a newline inside it starts
                // the bodies of here-documents opened before it.
                let mut text = format!(" ( {} )", self.list_with(depth + 1, pieces, bodies));
                if self.rng.percent(30) {
                    text.push(' ');
                    text.push_str(&self.redirect(depth, pieces, bodies));
                }
                return (text, false);
            }
            let mut text = String::new();
            // What the splitter keeps of the command: everything but redirections, the
            // blanks it skips after them, and comments.
            let mut kept = String::new();
            let mut after_redirect = false;
            if self.heads {
                let head = if self.rng.percent(4) {
                    PLANTED
                } else {
                    self.rng.pick(&HEADS)
                };
                text.push_str(head);
                kept.push_str(head);
            }
            let items = self.rng.below(4) + usize::from(!self.heads);
            for _ in 0..items {
                let redirect = self.rng.percent(20);
                if !text.is_empty() {
                    let separator = if redirect || after_redirect || self.heads {
                        " "
                    } else {
                        self.rng.pick(&[" ", " ", "\t", "  ", " \\\n", "\\\n "])
                    };
                    text.push_str(separator);
                    if !after_redirect {
                        kept.push_str(separator);
                    }
                }
                if redirect {
                    text.push_str(&self.redirect(depth, pieces, bodies));
                } else {
                    let word = self.word(depth, pieces, true);
                    text.push_str(&word);
                    kept.push_str(&word);
                }
                after_redirect = redirect;
            }
            let comment = self.rng.percent(12);
            if comment {
                // A redirection's target would run on into a line continuation.
                let opener = if after_redirect {
                    self.rng.pick(&[" #", "\t#", " \\\n#"])
                } else {
                    self.rng.pick(&[" #", "\t#", " \\\n#", "\\\n #"])
                };
                text.push_str(opener);
                let before_hash = &opener[..opener.len() - 1];
                kept.push_str(if after_redirect {
                    before_hash.trim_start_matches([' ', '\t'])
                } else {
                    before_hash
                });
                text.push_str(&self.rng.text(COMMENT, 10));
            }
            let piece = kept.trim();
            if !piece.is_empty() {
                pieces.push(piece.to_owned());
            }
            (text, comment)
        }

        /// One word of one or more parts. `#` starts a comment at the start of a word, and
        /// a line continuation does not start the word, since the shell removes it.
        fn word(&mut self, depth: usize, pieces: &mut Vec<String>, substitutions: bool) -> String {
            let mut text = String::new();
            let mut started = false;
            for part in 0..=self.rng.below(3) {
                let nest = substitutions && depth < MODEL_DEPTH;
                match self.rng.below(100) {
                    0..=34 => {
                        let mut plain = self.rng.text(PLAIN, 5);
                        if !started {
                            plain = plain.trim_start_matches('#').to_owned();
                        }
                        if plain.is_empty() {
                            plain.push('w');
                        }
                        text.push_str(&plain);
                    }
                    35..=46 => text.push_str(&self.single()),
                    47..=58 => text.push_str(&self.double(depth, pieces, substitutions)),
                    59..=64 => text.push_str(&self.ansi_c()),
                    65..=79 => {
                        let ch = self.rng.pick(ESCAPED);
                        text.push('\\');
                        text.push(ch);
                        if ch == '\n' {
                            continue;
                        }
                    }
                    80..=89 => text.push_str(&self.param(depth, pieces, false, substitutions)),
                    90..=93 if nest => {
                        text.push_str(&format!("$({})", self.list(depth + 1, pieces)));
                    }
                    94..=97 if nest => text.push_str(&self.backticks(depth, pieces, false)),
                    98..=99 if nest && part == 0 => {
                        // Process substitution only opens a word: after digits, `2<(` would
                        // read as a redirection.
                        let open = self.rng.pick(&["<(", ">("]);
                        text.push_str(&format!("{open}{})", self.list(depth + 1, pieces)));
                    }
                    _ => text.push('w'),
                }
                started = true;
            }
            text
        }

        fn single(&mut self) -> String {
            format!("'{}'", self.rng.text(SINGLE, 6))
        }

        fn ansi_c(&mut self) -> String {
            let mut text = String::from("$'");
            for _ in 0..self.rng.below(4) {
                if self.rng.percent(30) {
                    text.push_str(self.rng.pick(&["\\'", "\\\\", "\\n", "\\x41", "\\\""]));
                } else {
                    text.push(self.rng.pick(ANSI));
                }
            }
            text.push('\'');
            text
        }

        fn double(
            &mut self,
            depth: usize,
            pieces: &mut Vec<String>,
            substitutions: bool,
        ) -> String {
            let mut text = String::from('"');
            let nest = substitutions && depth < MODEL_DEPTH;
            for _ in 0..=self.rng.below(3) {
                match self.rng.below(10) {
                    0..=4 => text.push_str(&self.rng.text(DOUBLE, 5)),
                    5 => {
                        text.push('\\');
                        text.push(self.rng.pick(DOUBLE_ESCAPED));
                    }
                    6 => text.push_str(self.rng.pick(&["$x", "$1", "$@"])),
                    7 => text.push_str(&self.param(depth, pieces, true, substitutions)),
                    8 if nest => text.push_str(&format!("$({})", self.list(depth + 1, pieces))),
                    9 if nest => text.push_str(&self.backticks(depth, pieces, true)),
                    _ => text.push('a'),
                }
            }
            text.push('"');
            text
        }

        /// `` `…` ``, written the way the shell wants it: it removes the backslash from
        /// `\\`, `` \` `` and `\$` (and, within double quotes, `\"`) before running the
        /// command inside, so the command is written with those escaped.
        fn backticks(
            &mut self,
            depth: usize,
            pieces: &mut Vec<String>,
            in_double_quotes: bool,
        ) -> String {
            let inner = self.list(depth + 1, pieces);
            let mut text = String::from('`');
            for ch in inner.chars() {
                if matches!(ch, '\\' | '`' | '$') || (in_double_quotes && ch == '"') {
                    text.push('\\');
                }
                text.push(ch);
            }
            text.push('`');
            text
        }

        /// `${…}`. Blanks, `#`, `;` and the like stand for themselves inside it while
        /// quotes and substitutions nest; within double quotes, shells disagree about quotes
        /// inside it, so the splitter must refuse those.
        fn param(
            &mut self,
            depth: usize,
            pieces: &mut Vec<String>,
            in_double_quotes: bool,
            substitutions: bool,
        ) -> String {
            let name = self.rng.pick(&["x", "HOME", "1", "@"]);
            if self.rng.percent(30) {
                let hash = if self.rng.percent(30) { "#" } else { "" };
                return format!("${{{hash}{name}}}");
            }
            let operator = self
                .rng
                .pick(&[":-", "-", ":=", ":+", "#", "##", "%", "%%", "/", "//"]);
            let mut text = format!("${{{name}{operator}");
            let nest = substitutions && depth < MODEL_DEPTH;
            for _ in 0..=self.rng.below(3) {
                // Within double quotes a quote makes the splitter refuse, so keep those rare.
                let quotes = !in_double_quotes || self.rng.percent(10);
                match self.rng.below(10) {
                    0..=4 => text.push_str(&self.rng.text(PARAM, 5)),
                    5 => {
                        let ch = self.rng.pick(&['}', '\\', '$', '`', '"', 'a', ' ']);
                        text.push('\\');
                        text.push(ch);
                    }
                    6 if quotes => {
                        text.push_str(&self.single());
                        self.refused |= in_double_quotes;
                    }
                    7 if quotes => {
                        if in_double_quotes {
                            text.push_str("\"a\"");
                            self.refused = true;
                        } else {
                            text.push_str(&self.double(depth, pieces, substitutions));
                        }
                    }
                    8 if nest => text.push_str(&format!("$({})", self.list(depth + 1, pieces))),
                    _ => text.push('a'),
                }
            }
            text.push('}');
            text
        }

        /// A redirection. File redirections are pieces of their own; duplications, here-strings,
        /// here-documents and `/dev/null` touch no file and are dropped.
        fn redirect(
            &mut self,
            depth: usize,
            pieces: &mut Vec<String>,
            bodies: &mut Vec<Body>,
        ) -> String {
            if self.rng.percent(15) {
                return self.heredoc(bodies);
            }
            if self.heads {
                return self
                    .rng
                    .pick(&["2>&1", ">/dev/null", "2> /dev/null", ">&2", "<<< 'x'"])
                    .to_owned();
            }
            let gap = self.rng.pick(&["", " "]);
            match self.rng.below(4) {
                0 => {
                    let operator = self.rng.pick(&[">&", "<&", "2>&"]);
                    let target = self.rng.pick(&["1", "2", "-", "2-", "log"]);
                    let digits = target.strip_suffix('-').unwrap_or(target);
                    if !digits.chars().all(|c| c.is_ascii_digit()) {
                        pieces.push(format!("{operator} {target}"));
                    }
                    format!("{operator}{gap}{target}")
                }
                1 => format!("<<<{gap}{}", self.word(depth, pieces, false)),
                _ => {
                    let operator = self
                        .rng
                        .pick(&[">", ">>", "<", ">|", "<>", "&>", "&>>", "2>", "2>>", "10<"]);
                    let target = if self.rng.percent(15) {
                        "/dev/null".to_owned()
                    } else {
                        self.word(depth, pieces, false)
                    };
                    if target != "/dev/null" {
                        pieces.push(format!("{operator} {target}"));
                    }
                    format!("{operator}{gap}{target}")
                }
            }
        }

        fn heredoc(&mut self, bodies: &mut Vec<Body>) -> String {
            let (word, delimiter, decoy) = self.rng.pick(DELIMITERS);
            let strip_tabs = self.rng.percent(30);
            match delimiter {
                Some(delimiter) => bodies.push(Body {
                    delimiter,
                    strip_tabs,
                    quoted: word.contains(['\'', '"', '\\']),
                    decoy,
                }),
                None => self.refused = true,
            }
            let operator = if strip_tabs { "<<-" } else { "<<" };
            format!("{operator}{}{word}", self.rng.pick(&["", " "]))
        }

        /// The bodies of the here-documents opened on the line just ended. Without a quoted
        /// delimiter the shell expands `$` and backticks in a body and joins lines ending in
        /// `\`, so the splitter refuses those bodies.
        fn bodies(&mut self, bodies: &mut Vec<Body>, text: &mut String) {
            for body in bodies.drain(..) {
                for _ in 0..self.rng.below(4) {
                    let mut line = match body.decoy {
                        Some(decoy) if self.rng.percent(40) => decoy.to_owned(),
                        _ => self.rng.text(BODY, 8),
                    };
                    if self.rng.percent(5) {
                        line.push(self.rng.pick(&['$', '`']));
                    }
                    let odd_backslashes =
                        line.chars().rev().take_while(|&c| c == '\\').count() % 2 == 1;
                    if !body.quoted && (line.contains(['$', '`']) || odd_backslashes) {
                        self.refused = true;
                    }
                    if body.strip_tabs {
                        text.push_str(&"\t".repeat(self.rng.below(3)));
                    }
                    text.push_str(&line);
                    text.push('\n');
                }
                if body.strip_tabs {
                    text.push_str(&"\t".repeat(self.rng.below(3)));
                }
                text.push_str(body.delimiter);
                text.push('\n');
            }
        }
    }
}
