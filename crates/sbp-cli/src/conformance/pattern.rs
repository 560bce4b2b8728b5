//! The small regular-expression subset the vector files' `pattern` matchers use: anchors `^` `$`,
//! literals and escapes (`\.`, `\d`, `\w`, `\s`), `.`, bracket classes with ranges and negation,
//! and the quantifiers `*`, `+`, `?`. Anything else (groups, alternation, counted repetition) is
//! reported as unsupported rather than guessed at, so a matcher is never silently passed.

#[derive(Debug, Clone)]
enum Atom {
    Char(char),
    Any,
    /// (negated, ranges)
    Class(bool, Vec<(char, char)>),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Rep {
    One,
    ZeroOrOne,
    ZeroOrMore,
    OneOrMore,
}

#[derive(Debug)]
pub struct Pattern {
    start: bool,
    end: bool,
    items: Vec<(Atom, Rep)>,
}

const DIGIT: &[(char, char)] = &[('0', '9')];
const WORD: &[(char, char)] = &[('a', 'z'), ('A', 'Z'), ('0', '9'), ('_', '_')];
const SPACE: &[(char, char)] = &[(' ', ' '), ('\t', '\t'), ('\n', '\n'), ('\r', '\r')];

fn escape(c: char) -> Atom {
    match c {
        'd' => Atom::Class(false, DIGIT.to_vec()),
        'w' => Atom::Class(false, WORD.to_vec()),
        's' => Atom::Class(false, SPACE.to_vec()),
        'D' => Atom::Class(true, DIGIT.to_vec()),
        'W' => Atom::Class(true, WORD.to_vec()),
        'S' => Atom::Class(true, SPACE.to_vec()),
        other => Atom::Char(other),
    }
}

impl Pattern {
    /// `None` when the pattern uses syntax outside the subset.
    pub fn parse(src: &str) -> Option<Self> {
        let mut chars: Vec<char> = src.chars().collect();
        let start = chars.first() == Some(&'^');
        if start {
            chars.remove(0);
        }
        let end =
            chars.last() == Some(&'$') && !(chars.len() >= 2 && chars[chars.len() - 2] == '\\');
        if end {
            chars.pop();
        }
        let mut items = Vec::new();
        let mut i = 0;
        while i < chars.len() {
            let atom = match chars[i] {
                '(' | ')' | '|' | '{' | '}' | '^' | '$' => return None,
                '*' | '+' | '?' => return None,
                '.' => Atom::Any,
                '\\' => {
                    i += 1;
                    escape(*chars.get(i)?)
                }
                '[' => {
                    i += 1;
                    let negated = chars.get(i) == Some(&'^');
                    if negated {
                        i += 1;
                    }
                    let mut ranges = Vec::new();
                    let mut first = true;
                    loop {
                        let c = *chars.get(i)?;
                        if c == ']' && !first {
                            break;
                        }
                        first = false;
                        let lo = if c == '\\' {
                            i += 1;
                            match escape(*chars.get(i)?) {
                                Atom::Char(c) => c,
                                Atom::Class(false, r) => {
                                    ranges.extend(r);
                                    i += 1;
                                    continue;
                                }
                                _ => return None,
                            }
                        } else {
                            c
                        };
                        // `a-z`, but a `-` last in the class is a literal.
                        if chars.get(i + 1) == Some(&'-')
                            && chars.get(i + 2).is_some_and(|c| *c != ']')
                        {
                            let hi = *chars.get(i + 2)?;
                            ranges.push((lo, hi));
                            i += 3;
                        } else {
                            ranges.push((lo, lo));
                            i += 1;
                        }
                    }
                    Atom::Class(negated, ranges)
                }
                c => Atom::Char(c),
            };
            i += 1;
            let rep = match chars.get(i) {
                Some('*') => Rep::ZeroOrMore,
                Some('+') => Rep::OneOrMore,
                Some('?') => Rep::ZeroOrOne,
                _ => Rep::One,
            };
            if rep != Rep::One {
                i += 1;
            }
            items.push((atom, rep));
        }
        Some(Self { start, end, items })
    }

    pub fn is_match(&self, text: &str) -> bool {
        let chars: Vec<char> = text.chars().collect();
        let starts = if self.start { 0..=0 } else { 0..=chars.len() };
        starts.into_iter().any(|s| self.match_at(&chars, s, 0))
    }

    fn match_at(&self, text: &[char], pos: usize, item: usize) -> bool {
        let Some((atom, rep)) = self.items.get(item) else {
            return !self.end || pos == text.len();
        };
        let hits = |p: usize| text.get(p).is_some_and(|c| matches(atom, *c));
        match rep {
            Rep::One => hits(pos) && self.match_at(text, pos + 1, item + 1),
            Rep::ZeroOrOne => {
                (hits(pos) && self.match_at(text, pos + 1, item + 1))
                    || self.match_at(text, pos, item + 1)
            }
            Rep::ZeroOrMore | Rep::OneOrMore => {
                let mut n = 0;
                while hits(pos + n) {
                    n += 1;
                }
                let min = usize::from(*rep == Rep::OneOrMore);
                (min..=n)
                    .rev()
                    .any(|k| self.match_at(text, pos + k, item + 1))
            }
        }
    }
}

fn matches(atom: &Atom, c: char) -> bool {
    match atom {
        Atom::Char(x) => *x == c,
        Atom::Any => c != '\n',
        Atom::Class(negated, ranges) => {
            ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&c)) != *negated
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Pattern;

    fn m(p: &str, t: &str) -> bool {
        Pattern::parse(p).expect("supported").is_match(t)
    }

    #[test]
    fn the_vectors_jwt_pattern() {
        let jwt = r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+$";
        assert!(m(jwt, "eyJhbGci.eyJzdWIi.sig-_09"));
        assert!(!m(jwt, "eyJhbGci.eyJzdWIi"));
        assert!(!m(jwt, "a.b.c.d"));
        assert!(!m(jwt, "a.b.c d"));
        assert!(!m(jwt, ".b.c"));
    }

    #[test]
    fn anchors_quantifiers_and_classes() {
        assert!(m("^ab?c*d+$", "add"));
        assert!(m("^ab?c*d+$", "abccd"));
        assert!(!m("^ab?c*d+$", "abbd"));
        assert!(m(r"\d\d", "x12y"));
        assert!(!m(r"^\d\d$", "x12y"));
        assert!(m("^[^x]+$", "abc"));
        assert!(!m("^[^x]+$", "axc"));
        assert!(m("^a.c$", "abc"));
        assert!(m("^[a-]+$", "a-a"));
        assert!(m("^$", ""));
    }

    #[test]
    fn unsupported_syntax_is_refused() {
        for p in ["(a|b)", "a{2}", "a|b", "^*a"] {
            assert!(Pattern::parse(p).is_none(), "{p}");
        }
    }
}
