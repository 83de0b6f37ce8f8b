//! Test support: a test run again, alone, in a child process with what the
//! parent cannot give itself: no capabilities (file modes bind it, as they
//! bind a Nix build user or any non-root developer), or an empty PATH.

use std::path::PathBuf;
use std::process::Command;

/// The environment variable that marks the re-run child.
const CHILD: &str = "KILN_XTASK_TEST_CHILD";

/// Whether this process is a re-run child (the test's body runs here).
pub fn in_child() -> bool {
    std::env::var_os(CHILD).is_some()
}

/// Runs the test `name` again in a child: the test binary, started by
/// `launch` (given its path); asserts that the child ran it and passed.
pub fn run_child(name: &str, launch: impl FnOnce(PathBuf) -> Command) {
    let mut command = launch(std::env::current_exe().expect("the test binary's path"));
    command
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1");
    let output = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", command.get_program()));
    let text = build_support::process::text(&output);
    assert!(
        output.status.success() && text.contains("1 passed"),
        "{name} failed in its child:\n{text}"
    );
    eprintln!("{text}");
}

/// Whether this process may write files it has no write bit on
/// (`CAP_DAC_OVERRIDE`, bit 1 of the effective capability set).
fn has_dac_override() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 1) != 0)
}

/// When this process can override file modes (root), runs the test `name`
/// again in a child without any capability (`setpriv`, of util-linux) and
/// returns true: the caller then returns. Otherwise returns false and the
/// caller runs its body here, already unprivileged.
pub fn rerun_without_dac_override(name: &str) -> bool {
    if in_child() {
        assert!(
            !has_dac_override(),
            "the re-run child still has CAP_DAC_OVERRIDE"
        );
        return false;
    }
    if !has_dac_override() {
        return false;
    }
    run_child(name, |exe| {
        let mut setpriv = Command::new("setpriv");
        setpriv
            .args(["--inh-caps=-all", "--bounding-set=-all", "--"])
            .arg(exe);
        setpriv
    });
    true
}
