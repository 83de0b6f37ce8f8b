//! The identity of the CPU that `--iree-llvmcpu-target-cpu=host` compiles
//! for, as part of a module's cache key: LLVM resolves `host` to this CPU's
//! model and instruction-set extensions, so a module compiled on one CPU can
//! hold instructions another lacks (an AVX-512 module dies with SIGILL on a
//! CPU without it). Two machines whose kernels report the same vendor,
//! family, model and feature flags get the same code from LLVM.

use std::path::Path;
use std::sync::OnceLock;

/// The `/proc/cpuinfo` fields that decide LLVM's host CPU and features
/// (x86: vendor, family, model, flags; Arm: implementer, part, features).
const FIELDS: &[&str] = &[
    "vendor_id",
    "cpu family",
    "model",
    "model name",
    "flags",
    "CPU implementer",
    "CPU architecture",
    "CPU variant",
    "CPU part",
    "Features",
];

/// This machine's CPU identity, read once, or why it cannot be read (the
/// caller wraps it in its error: this file stays below the crate's errors).
pub fn identity() -> Result<&'static str, String> {
    static IDENTITY: OnceLock<Result<String, String>> = OnceLock::new();
    IDENTITY
        .get_or_init(|| {
            let text = kiln_core::files::read_text_limited(
                Path::new("/proc/cpuinfo"),
                16 << 20,
                "/proc/cpuinfo",
            )
            .map_err(|e| e.to_string())?;
            from_cpuinfo(&text)
        })
        .as_deref()
        .map_err(String::clone)
}

/// The identity in `/proc/cpuinfo`'s text: [`FIELDS`] of the first
/// processor, in order (hybrid CPUs report the same flags on every core).
pub fn from_cpuinfo(text: &str) -> Result<String, String> {
    let first = text.split("\n\n").next().unwrap_or_default();
    let mut identity = String::new();
    for field in FIELDS {
        let value = first.lines().find_map(|line| {
            let (name, value) = line.split_once(':')?;
            (name.trim() == *field).then(|| value.trim())
        });
        if let Some(value) = value {
            identity.push_str(&format!("{field}: {value}\n"));
        }
    }
    if !identity.contains("flags:") && !identity.contains("Features:") {
        return Err("/proc/cpuinfo lists no CPU features".into());
    }
    Ok(identity)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SKYLAKE_X: &str = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n\
        model\t\t: 85\nmodel name\t: Intel(R) Xeon(R)\ncpu MHz\t\t: 2000.000\n\
        flags\t\t: fpu sse2 avx avx2 avx512f\n\nprocessor\t: 1\ncpu MHz\t\t: 2100.000\n";

    #[test]
    fn the_identity_holds_the_features_not_the_clock() {
        let a = from_cpuinfo(SKYLAKE_X).unwrap();
        assert!(a.contains("avx512f") && a.contains("model: 85"), "{a}");
        assert!(!a.contains("MHz"), "{a}");
        let no_avx512 = from_cpuinfo(&SKYLAKE_X.replace(" avx512f", "")).unwrap();
        assert_ne!(a, no_avx512);
        assert!(from_cpuinfo("processor: 0\n").is_err());
    }

    #[test]
    fn this_machine_has_an_identity() {
        assert!(!identity().unwrap().is_empty());
    }
}
