//! The page's words as data: a piece of text whose `backticked` stretches are set as code
//! (`Text`), and a reading split into its finding and the rest (`Finding`), for the card, the
//! tables and the folded readings alike.

use serde::Serialize;

/// A piece of text whose `backticked` stretches are set as code.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Text {
    /// Its stretches, in order.
    pub spans: Vec<Span>,
}

/// A stretch of a [`Text`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span {
    /// The words.
    pub text: String,
    /// Whether it was between backticks.
    pub code: bool,
}

impl From<&str> for Text {
    fn from(s: &str) -> Self {
        let spans = s
            .split('`')
            .enumerate()
            .filter(|(_, t)| !t.is_empty())
            .map(|(i, t)| Span { text: t.to_string(), code: i % 2 == 1 })
            .collect();
        Text { spans }
    }
}

/// A reading folded on the page: its finding, then the rest of what it says.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// Its first sentence.
    pub finding: Text,
    /// The sentences after it (empty where it has one).
    pub more: Text,
}

impl Finding {
    /// A reading's paragraph split after its first sentence: at the first full stop outside
    /// brackets and backticks that a space and a capital (or a backtick) follow, so "1.25x",
    /// "e.g. a" and a sentence in brackets do not end it.
    pub fn of(paragraph: &str) -> Finding {
        let chars: Vec<(usize, char)> = paragraph.char_indices().collect();
        let (mut depth, mut code) = (0i32, false);
        let mut cut = None;
        for (k, &(i, c)) in chars.iter().enumerate() {
            match c {
                '(' | '[' if !code => depth += 1,
                ')' | ']' if !code => depth -= 1,
                '`' => code = !code,
                '.' if depth <= 0 && !code => {
                    let next = chars.get(k + 1).map(|x| x.1);
                    let after = chars.get(k + 2).map(|x| x.1);
                    if next == Some(' ') && after.is_some_and(|a| a.is_uppercase() || a == '`') {
                        cut = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        let (head, tail) = paragraph.split_at(cut.unwrap_or(paragraph.len()));
        Finding { finding: Text::from(head.trim()), more: Text::from(tail.trim()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finding_is_the_first_sentence_outside_brackets() {
        let f = Finding::of("At 4 workers: a (median of 3. Odd) is 1.25x faster. Why: e.g. less. The end.");
        assert_eq!(f.finding, Text::from("At 4 workers: a (median of 3. Odd) is 1.25x faster."));
        assert_eq!(f.more, Text::from("Why: e.g. less. The end."));
        assert_eq!(Finding::of("One sentence.").more, Text::default());
        let t = Text::from("run `gradsync-bench compare` here");
        assert_eq!(t.spans.len(), 3);
        assert!(t.spans[1].code && t.spans[1].text == "gradsync-bench compare");
    }
}
