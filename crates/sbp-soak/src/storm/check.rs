//! The storm's checker, pure: given what the gateway acknowledged (in the order it was sent, one
//! request at a time per session) and what it holds afterwards (a transcript, or what a surface
//! received), count what was lost, duplicated, reordered or changed.
//!
//! Every message the storm sends carries a tag (`c0.3.17`: lane, session, item), so a stored
//! message is recognised by its text alone. A completion item leaves two messages in the
//! transcript (`ask TAG ...` from the user, `echo: ask TAG ...` from the fake model) and one turn
//! on the surface (the reply); a pushed turn (`push TAG ...`) leaves one of each.

use std::collections::{HashMap, HashSet};

/// Which message of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Part {
    /// The user message of a completion.
    Ask,
    /// The model's reply to it.
    Reply,
    /// A turn pushed by a backend.
    Push,
}

/// A message the storm sent or expects, recognised by its tag.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Mark {
    pub tag: String,
    pub part: Part,
}

/// Recognises a storm message by its text (role included, so a user message cannot pass for a
/// reply). `None`: not one of the storm's.
pub fn mark_of(role: &str, content: &str) -> Option<Mark> {
    let mut words = content.split(' ');
    let (part, tag) = match (role, words.next()?) {
        ("user", "ask") => (Part::Ask, words.next()?),
        ("assistant", "echo:") if words.next()? == "ask" => (Part::Reply, words.next()?),
        ("assistant", "push") => (Part::Push, words.next()?),
        _ => return None,
    };
    Some(Mark {
        tag: tag.to_owned(),
        part,
    })
}

/// One expected message: its mark, its exact text, and whether the gateway acknowledged it (an
/// item that was never acknowledged may be present once or not at all, never twice).
#[derive(Debug, Clone)]
pub struct Expect {
    pub mark: Mark,
    pub content: String,
    pub acked: bool,
    /// How it was sent (`push, 2 attempts`), for the examples.
    pub sent: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Acknowledged messages missing.
    pub lost: usize,
    /// Extra copies of a message.
    pub duplicated: usize,
    /// Messages found before one that was sent (and acknowledged) earlier.
    pub reordered: usize,
    /// A message with the right tag but other text, or text that is none of the storm's.
    pub corrupted: usize,
    /// Up to a few descriptions per kind, for the report.
    pub examples: Vec<String>,
}

impl Tally {
    pub fn add(&mut self, other: Tally) {
        self.lost += other.lost;
        self.duplicated += other.duplicated;
        self.reordered += other.reordered;
        self.corrupted += other.corrupted;
        for e in other.examples {
            self.example(e);
        }
    }

    pub fn clean(&self) -> bool {
        self.lost == 0 && self.duplicated == 0 && self.reordered == 0 && self.corrupted == 0
    }

    fn example(&mut self, e: String) {
        if self.examples.len() < 12 {
            self.examples.push(e);
        }
    }
}

/// Compares what was found (in the order the gateway gives it, text included) with what was
/// expected (in the order it was sent). `what` names the place, for the examples.
pub fn check(what: &str, expected: &[Expect], found: &[(Option<Mark>, String)]) -> Tally {
    let mut t = Tally::default();
    let position: HashMap<&Mark, usize> = expected
        .iter()
        .enumerate()
        .map(|(i, e)| (&e.mark, i))
        .collect();
    let mut count: HashMap<&Mark, usize> = HashMap::new();
    let mut seen: HashSet<&Mark> = HashSet::new();
    let mut furthest: Option<usize> = None;
    for (mark, text) in found {
        let Some(mark) = mark else {
            t.corrupted += 1;
            t.example(format!("{what}: message not sent by the storm: {text:?}"));
            continue;
        };
        let Some(&pos) = position.get(mark) else {
            t.corrupted += 1;
            t.example(format!("{what}: unknown tag {mark:?}: {text:?}"));
            continue;
        };
        *count.entry(&expected[pos].mark).or_default() += 1;
        if expected[pos].content != *text {
            t.corrupted += 1;
            t.example(format!(
                "{what}: {mark:?} reads {text:?}, sent {:?}",
                expected[pos].content
            ));
        }
        if !seen.insert(&expected[pos].mark) {
            continue;
        }
        match furthest {
            Some(f) if pos < f => {
                t.reordered += 1;
                t.example(format!(
                    "{what}: {mark:?} comes after {:?}, which was sent later",
                    expected[f].mark
                ));
            }
            _ => furthest = Some(pos),
        }
    }
    for e in expected {
        let c = count.get(&e.mark).copied().unwrap_or(0);
        if e.acked && c == 0 {
            t.lost += 1;
            t.example(format!("{what}: acknowledged {:?} is missing", e.mark));
        }
        if c > 1 {
            t.duplicated += c - 1;
            t.example(format!(
                "{what}: {:?} is there {c} times ({}, {})",
                e.mark,
                e.sent,
                if e.acked {
                    "acknowledged"
                } else {
                    "never acknowledged"
                }
            ));
        }
    }
    t
}

/// What a surface received, in order: `(seq, text)` for every turn frame that carried a seq,
/// repeats included (delivery is at least once). Checks that a seq always carries the same text
/// and that new seqs only grow, then returns each distinct turn once, in seq order, for [`check`].
pub fn surface_turns(what: &str, deliveries: &[(u64, String)]) -> (Vec<(u64, String)>, Tally) {
    let mut t = Tally::default();
    let mut by_seq: HashMap<u64, &str> = HashMap::new();
    let mut highest = 0u64;
    let mut distinct = Vec::new();
    for (seq, text) in deliveries {
        match by_seq.get(seq) {
            Some(prev) if *prev != text => {
                t.corrupted += 1;
                t.example(format!(
                    "{what}: seq {seq} delivered as {prev:?}, then as {text:?}"
                ));
            }
            Some(_) => {}
            None => {
                if *seq <= highest {
                    t.reordered += 1;
                    t.example(format!(
                        "{what}: seq {seq} first delivered after seq {highest}"
                    ));
                }
                highest = highest.max(*seq);
                by_seq.insert(*seq, text);
                distinct.push((*seq, text.clone()));
            }
        }
    }
    distinct.sort_by_key(|(seq, _)| *seq);
    (distinct, t)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(tag: &str, part: Part, acked: bool) -> Expect {
        let content = match part {
            Part::Ask => format!("ask {tag} x"),
            Part::Reply => format!("echo: ask {tag} x"),
            Part::Push => format!("push {tag} y"),
        };
        Expect {
            mark: Mark {
                tag: tag.into(),
                part,
            },
            content,
            acked,
            sent: String::new(),
        }
    }

    fn found(e: &Expect) -> (Option<Mark>, String) {
        let role = if e.mark.part == Part::Ask {
            "user"
        } else {
            "assistant"
        };
        (mark_of(role, &e.content), e.content.clone())
    }

    #[test]
    fn marks_are_read_from_role_and_text() {
        let m = mark_of("user", "ask c0.1.2 some words").expect("mark");
        assert_eq!((m.tag.as_str(), m.part), ("c0.1.2", Part::Ask));
        let m = mark_of("assistant", "echo: ask c0.1.2 some words").expect("mark");
        assert_eq!(m.part, Part::Reply);
        assert_eq!(
            mark_of("assistant", "push s1.0.9").map(|m| m.part),
            Some(Part::Push)
        );
        assert_eq!(mark_of("assistant", "ask c0.1.2"), None);
        assert_eq!(mark_of("system", "push x"), None);
        assert_eq!(mark_of("user", ""), None);
    }

    #[test]
    fn a_faithful_transcript_is_clean_and_unacknowledged_items_may_be_absent() {
        let expected = vec![
            ex("a", Part::Ask, true),
            ex("a", Part::Reply, true),
            ex("b", Part::Push, false),
            ex("c", Part::Push, true),
        ];
        let all: Vec<_> = expected.iter().map(found).collect();
        assert!(check("s", &expected, &all).clean());
        let without_b: Vec<_> = [0, 1, 3].iter().map(|&i| found(&expected[i])).collect();
        assert!(check("s", &expected, &without_b).clean());
    }

    #[test]
    fn loss_duplication_reordering_and_corruption_are_counted() {
        let expected = vec![
            ex("a", Part::Ask, true),
            ex("a", Part::Reply, true),
            ex("b", Part::Push, false),
            ex("c", Part::Push, true),
        ];
        // c before a's reply; b twice (never acknowledged: still a duplicate); a's ask missing.
        let got = vec![
            found(&expected[3]),
            found(&expected[1]),
            found(&expected[2]),
            found(&expected[2]),
        ];
        let t = check("s", &expected, &got);
        assert_eq!(
            (t.lost, t.duplicated, t.reordered, t.corrupted),
            (1, 1, 2, 0),
            "{t:?}"
        );
        let mut changed = found(&expected[0]);
        changed.1.push('!');
        let stranger = (None, "hello".to_owned());
        let t = check("s", &expected[..1], &[changed, stranger]);
        assert_eq!(t.corrupted, 2, "{t:?}");
    }

    #[test]
    fn surface_repeats_are_folded_and_checked() {
        let d = vec![
            (3, "x".to_owned()),
            (4, "y".to_owned()),
            (4, "y".to_owned()),
            (5, "z".to_owned()),
        ];
        let (distinct, t) = surface_turns("s", &d);
        assert!(t.clean(), "{t:?}");
        assert_eq!(distinct.len(), 3);
        let bad = vec![
            (3, "x".to_owned()),
            (3, "q".to_owned()),
            (2, "w".to_owned()),
        ];
        let (_, t) = surface_turns("s", &bad);
        assert_eq!((t.corrupted, t.reordered), (1, 1), "{t:?}");
    }
}
