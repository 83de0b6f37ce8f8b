//! Test support: running a test as a user who cannot write through file
//! modes, as a Nix build user or any non-root developer meets them.

use std::process::Command;

/// The environment variable that marks the re-run child.
const CHILD: &str = "KILN_XTASK_TEST_UNPRIVILEGED";

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
/// again in a child without any capability (`setpriv`), asserts that it
/// passed, and returns true: the caller then returns. Otherwise returns false
/// and the caller runs its body here, already unprivileged.
pub fn rerun_without_dac_override(name: &str) -> bool {
    if std::env::var_os(CHILD).is_some() {
        assert!(
            !has_dac_override(),
            "the re-run child still has CAP_DAC_OVERRIDE"
        );
        return false;
    }
    if !has_dac_override() {
        return false;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = Command::new("setpriv")
        .args(["--inh-caps=-all", "--bounding-set=-all", "--"])
        .arg(exe)
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .expect("setpriv (util-linux) is needed to run this test without CAP_DAC_OVERRIDE as root");
    let text = String::from_utf8_lossy(&output.stdout).into_owned()
        + &String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && text.contains("1 passed"),
        "{name} failed without CAP_DAC_OVERRIDE:\n{text}"
    );
    true
}
