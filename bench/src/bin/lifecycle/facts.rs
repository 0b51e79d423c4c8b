//! The planted facts of the lifecycle experiment's conversations: what
//! the user states (a code, a room, a flight, …), the question that asks
//! for it and the answer's primed prefix, and the conversation built
//! around them from chitchat filler.

/// A fact the user states: the statement, the question, the answer prefix
/// the model completes, and how to draw a value.
struct FactKind {
    statement: &'static str,
    question: &'static str,
    prefix: &'static str,
    values: &'static [&'static str],
}

const NAMES: &[&str] = &[
    "Marta", "Jonas", "Priya", "Tomas", "Ingrid", "Kofi", "Elena", "Dmitri", "Aiko", "Rafael",
];
const CODES: &[&str] = &[
    "4821", "7730", "1596", "3364", "9042", "2718", "6150", "8473", "5209", "3881",
];
const ROOMS: &[&str] = &["214", "507", "330", "118", "642", "905", "271", "483"];
const FLIGHTS: &[&str] = &[
    "KL417", "BA902", "LH338", "AF156", "SK771", "IB624", "AY205", "OS489",
];
const WORDS: &[&str] = &[
    "maple42", "harbor17", "violet88", "copper35", "falcon63", "meadow29",
];

const FACTS: [FactKind; 6] = [
    FactKind {
        statement: "My locker code is {}.",
        question: "What is my locker code?",
        prefix: "Your locker code is",
        values: CODES,
    },
    FactKind {
        statement: "My cousin is called {}.",
        question: "What is my cousin called?",
        prefix: "Your cousin is called",
        values: NAMES,
    },
    FactKind {
        statement: "My flight number is {}.",
        question: "What is my flight number?",
        prefix: "Your flight number is",
        values: FLIGHTS,
    },
    FactKind {
        statement: "The meeting is in room {}.",
        question: "Which room is the meeting in?",
        prefix: "The meeting is in room",
        values: ROOMS,
    },
    FactKind {
        statement: "My dog is called {}.",
        question: "What is my dog called?",
        prefix: "Your dog is called",
        values: NAMES,
    },
    FactKind {
        statement: "The wifi password is {}.",
        question: "What is the wifi password?",
        prefix: "The wifi password is",
        values: WORDS,
    },
];

/// What a question checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Probe {
    /// A fact stated once.
    Kept,
    /// A fact stated, then updated: the newer value is expected.
    Updated,
    /// Never stated: a hit is a guess.
    Control,
}

/// One user turn of a conversation.
pub(crate) struct Turn {
    pub(crate) text: String,
    /// For a question: the answer prefix, the expected value, the old
    /// value of an updated fact, and what it probes.
    pub(crate) question: Option<(String, String, Option<String>, Probe)>,
}

/// Facts 0..3 stated in turns 1..=3, fact 0 updated after half the filler,
/// fact 3 (never stated) the control; then the questions.
pub(crate) fn build_conversation(filler: &[String], seed: u64) -> Vec<Turn> {
    let mut rng = kvforge_bench::SplitMix::new(seed);
    // Four distinct kinds: 3 stated, 1 control.
    let mut kinds: Vec<usize> = (0..FACTS.len()).collect();
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.range(0, i as u32) as usize);
    }
    let kinds = &kinds[..4];
    let mut pick = |v: &'static [&'static str]| v[rng.range(0, v.len() as u32 - 1) as usize];
    let values: Vec<&str> = kinds.iter().map(|&k| pick(FACTS[k].values)).collect();
    let mut newer = pick(FACTS[kinds[0]].values);
    while newer == values[0] {
        newer = pick(FACTS[kinds[0]].values);
    }
    let say = |k: usize, v: &str| FACTS[k].statement.replace("{}", v);
    let mut turns = Vec::new();
    let mut f = filler.iter();
    let mut next_filler = || f.next().cloned().unwrap_or_else(|| "Tell me more.".into());
    turns.push(Turn {
        text: next_filler(),
        question: None,
    });
    for i in 0..3 {
        turns.push(Turn {
            text: format!("{} By the way, {}", next_filler(), say(kinds[i], values[i])),
            question: None,
        });
    }
    let n_filler = filler.len().saturating_sub(4);
    for j in 0..n_filler {
        if j == n_filler / 2 {
            turns.push(Turn {
                text: format!("{} One correction: {}", next_filler(), say(kinds[0], newer)),
                question: None,
            });
        } else {
            turns.push(Turn {
                text: next_filler(),
                question: None,
            });
        }
    }
    for (i, &k) in kinds.iter().enumerate() {
        let (expect, old, probe) = match i {
            0 => (
                newer.to_string(),
                Some(values[0].to_string()),
                Probe::Updated,
            ),
            3 => (values[3].to_string(), None, Probe::Control),
            _ => (values[i].to_string(), None, Probe::Kept),
        };
        turns.push(Turn {
            text: FACTS[k].question.to_string(),
            question: Some((FACTS[k].prefix.to_string(), expect, old, probe)),
        });
    }
    turns
}
