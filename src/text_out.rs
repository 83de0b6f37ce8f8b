//! Writing streamed text to the terminal as it becomes final.

use std::io::Write;

/// Writes `text` (if any) and flushes, so that it shows at once.
pub fn print_text(out: &mut impl Write, text: Option<&str>) -> kiln_core::Result<()> {
    let Some(text) = text else { return Ok(()) };
    let io = |error| kiln_core::Error::Write {
        what: "stdout",
        error,
    };
    out.write_all(text.as_bytes()).map_err(io)?;
    out.flush().map_err(io)
}
