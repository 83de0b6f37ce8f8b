//! The one way the build tasks run a program: [`run`] (its output the user's
//! to see), [`read`] (its stdout captured), [`output`] and [`output_text`]
//! (both captured, success the caller's to judge) and [`logged`] (a long
//! build: a progress bar, the output in a log). Each error names the program
//! that could not start or failed, with its status.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, ExitStatus, Output};

use anyhow::{Context, Result, anyhow};
use indicatif::{ProgressBar, ProgressStyle};

/// Runs `command`, which must succeed; `what` says what it does.
pub fn run(command: &mut Command, what: &str) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("cannot run {what} ({:?})", command.get_program()))?;
    if !status.success() {
        return Err(anyhow!("{what} failed ({status})"));
    }
    Ok(())
}

/// Runs `command` with its output captured; the caller judges the status.
pub fn output(command: &mut Command) -> Result<Output> {
    command
        .output()
        .with_context(|| format!("cannot run {:?}", command.get_program()))
}

/// Runs `command` with its output captured; its status, and its stdout then
/// stderr as one text (for a tool that reports on either).
pub fn output_text(command: &mut Command) -> Result<(ExitStatus, String)> {
    let out = output(command)?;
    Ok((out.status, text(&out)))
}

/// A finished command's stdout then stderr, as text.
pub fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// Runs `command`, which must succeed; its stdout, trimmed. A failure
/// carries its stderr.
pub fn read(command: &mut Command) -> Result<String> {
    Ok(String::from_utf8_lossy(&read_bytes(command)?)
        .trim()
        .to_string())
}

/// [`read`], the stdout as it came (a listing of NUL-separated paths, PTX).
pub fn read_bytes(command: &mut Command) -> Result<Vec<u8>> {
    let out = output(command)?;
    if !out.status.success() {
        return Err(anyhow!(
            "{command:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(out.stdout)
}

/// Reads `(done, total)` from a line of a tool's output, if it has one.
pub type ProgressParser = fn(&str) -> Option<(u64, u64)>;

/// Runs a long command with a spinner or progress bar, its output going to
/// `log`; on failure prints the output's tail and names the log.
pub fn logged(
    mut command: Command,
    log: &Path,
    what: &str,
    progress: Option<ProgressParser>,
) -> Result<()> {
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {msg} {wide_bar} {pos}/{len} [{elapsed}]")
            .expect("valid template"),
    );
    bar.set_message(what.to_string());
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    // stdout and stderr share one pipe so the log keeps their interleaving.
    let (reader, writer) = std::io::pipe()?;
    command.stdout(writer.try_clone()?).stderr(writer);
    let mut child = command
        .spawn()
        .with_context(|| format!("{what}: cannot start {:?}", command.get_program()))?;
    // The Command holds the pipe's write ends; drop it so the read sees EOF.
    drop(command);
    let mut log_text = String::new();
    let mut tail: VecDeque<String> = VecDeque::new();
    for line in BufReader::new(reader).lines() {
        let line = line?;
        if let Some((done, total)) = progress.and_then(|parse| parse(&line)) {
            bar.set_length(total);
            bar.set_position(done);
        }
        log_text.push_str(&line);
        log_text.push('\n');
        tail.push_back(line);
        if tail.len() > 40 {
            tail.pop_front();
        }
    }
    let status = child.wait()?;
    bar.finish_and_clear();
    std::fs::write(log, &log_text)?;
    if !status.success() {
        let tail: Vec<String> = tail.into();
        return Err(anyhow!(
            "{what} failed ({status}); last lines:\n{}\nfull log: {}",
            tail.join("\n"),
            log.display()
        ));
    }
    eprintln!("{what}: done");
    Ok(())
}
