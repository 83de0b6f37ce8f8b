//! Free disk space, where `cargo xtask test` writes: its build folder and the
//! system's temporary folder (the gate's mutants). A run that fills the disk
//! dies inside whichever compiler or linker wrote last, with an error that
//! does not say the suite needed more room; these lines say it up front and
//! after every step.

use std::path::Path;

use crate::process::target_dir;

/// The most the suite occupied at once, rounded up: 7.7 GiB (the file
/// system's used space sampled every minute) in a `.ci/run` from a fresh
/// clone, aarch64 steps included, with `.ci/run`'s settings (no incremental
/// state, line tables only): the build folders, the IREE cache inside the
/// clone and the gate's and repro's scratch copies together. With full
/// debug info the debug folder alone is about twice as large (docs/gate.md).
const PEAK_GIB: f64 = 10.0;

/// Prints a warning (not an error: the figure is an estimate, and a warm
/// build folder needs less) when the build folder's file system has less
/// free space than the suite has been measured to use.
pub fn warn_if_short() {
    let target = target_dir();
    match free_gib(&target) {
        Some(free) if free < PEAK_GIB => eprintln!(
            "xtask test: WARNING: {free:.1} GiB free on the file system of {}, and a run from \
             a fresh clone has used up to {PEAK_GIB:.0} GiB; free some space, or point \
             CARGO_TARGET_DIR at a larger disk, before a step dies with 'No space left on device'",
            target.display()
        ),
        Some(free) => eprintln!(
            "xtask test: {free:.1} GiB free on the file system of {} (a fresh run uses up to \
             {PEAK_GIB:.0} GiB)",
            target.display()
        ),
        None => {}
    }
}

/// "N GiB free" for the build folder, and for the temporary folder when it is
/// on another file system; empty where free space cannot be read.
pub fn free_space_line() -> String {
    let target = target_dir();
    let temp = std::env::temp_dir();
    let mut parts = Vec::new();
    if let Some(free) = free_gib(&target) {
        parts.push(format!("{free:.1} GiB free in target"));
    }
    if !same_file_system(&target, &temp)
        && let Some(free) = free_gib(&temp)
    {
        parts.push(format!("{free:.1} GiB free in {}", temp.display()));
    }
    parts.join(", ")
}

/// The free space of `path`'s file system: its nearest existing parent's
/// (the build folder may not exist before the first build).
fn free_gib(path: &Path) -> Option<f64> {
    let existing = path.ancestors().find(|p| p.exists())?;
    let stat = rustix::fs::statvfs(existing).ok()?;
    Some((stat.f_bavail as f64) * (stat.f_frsize as f64) / f64::from(1u32 << 30))
}

fn same_file_system(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let device = |p: &Path| {
        p.ancestors()
            .find(|p| p.exists())
            .and_then(|p| std::fs::metadata(p).ok())
            .map(|m| m.dev())
    };
    device(a).is_some() && device(a) == device(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder not made yet has its parent's free space and file system.
    #[test]
    fn a_missing_folder_is_on_its_parents_file_system() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("not/yet/built");
        let free = free_gib(&missing).expect("the temporary folder's file system answers");
        assert!(free > 0.0, "{free}");
        let parent = free_gib(dir.path()).unwrap();
        assert!((parent - free).abs() < 1.0, "{parent} vs {free}");
        assert!(same_file_system(dir.path(), &missing));
    }
}
