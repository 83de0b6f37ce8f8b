//! Running third-party parsers that may panic on malformed input (the
//! `tokenizers` crate does, on some tokenizer.json files) so that a panic
//! becomes an error: caught, and not printed as a crash.

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

thread_local! {
    /// Set while this thread runs a [`contain`]ed call.
    static CONTAINING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`; a panic inside it is returned as its message. The panic hook
/// keeps printing every other panic (of other threads, or outside `f`).
pub fn contain<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CONTAINING.with(Cell::get) {
                previous(info);
            }
        }));
    });
    let was = CONTAINING.with(|c| c.replace(true));
    // The state `f` may leave half-updated is the caller's object, which a
    // caller treats as failed.
    let result = catch_unwind(AssertUnwindSafe(f));
    CONTAINING.with(|c| c.set(was));
    result.map_err(|payload| {
        payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_its_message() {
        assert_eq!(contain(|| 7), Ok(7));
        assert_eq!(
            contain(|| -> u8 { panic!("bad {}", 1) }),
            Err("bad 1".into())
        );
        let nested = contain(|| contain(|| -> u8 { panic!("inner") }));
        assert_eq!(nested, Ok(Err("inner".into())));
    }
}
