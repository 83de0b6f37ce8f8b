//! Stop strings, found in the streamed text even when one spans several
//! tokens: text that may be the start of a stop string is held back until
//! the next piece shows whether it is one.

pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What one piece of text gave: the text now safe to send, and whether a
/// stop string ended the generation (the stop string itself is not sent).
#[derive(Debug, PartialEq, Eq)]
pub struct Matched {
    pub text: String,
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, piece: &str) -> Matched {
        self.held.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Matched {
                text,
                stopped: true,
            };
        }
        let keep = self.longest_stop_prefix_suffix();
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Matched {
            text,
            stopped: false,
        }
    }

    /// The text still held when the generation ends another way.
    pub fn finish(self) -> String {
        self.held
    }

    /// The length of the longest end of `held` that begins some stop string.
    fn longest_stop_prefix_suffix(&self) -> usize {
        let held = self.held.as_str();
        (1..=held.len())
            .rev()
            .filter(|&k| held.is_char_boundary(held.len() - k))
            .find(|&k| {
                let tail = &held[held.len() - k..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn a_stop_string_across_pieces_ends_the_text_before_it() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "Dxyz"]),
            ("abc ".into(), true)
        );
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(run(&["END"], &["E", "N", "x"]), ("ENx".into(), false));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("aE").text, "a");
        assert_eq!(m.push("Nq").text, "ENq");
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(run(&["yz", "b"], &["abcxyz"]), ("a".into(), true));
    }

    #[test]
    fn held_text_is_flushed_at_the_end_and_multibyte_is_safe() {
        assert_eq!(run(&["éé"], &["aé"]), ("aé".into(), false));
        assert_eq!(run(&["éé"], &["aé", "é"]), ("a".into(), true));
    }
}
