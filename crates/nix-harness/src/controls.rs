//! The evaluation's negative controls: mistakes it must refuse. Each is an
//! edit to a copy of the checkout and the text Nix's error must hold; an
//! edit that evaluates, or fails for another reason, fails `eval-nix`.

use std::path::Path;

use anyhow::{Result, anyhow};
use serde_json::{Value, json};

use crate::Checkout;
use crate::driver::evaluate_raw;
use crate::inputs::Inputs;

struct Control {
    name: &'static str,
    file: &'static str,
    from: &'static str,
    to: &'static str,
    expect: &'static str,
}

const CONTROLS: &[Control] = &[
    Control {
        name: "misspelt crane argument",
        file: "nix/checks.nix",
        from: "cargoTestExtraArgs =",
        to: "cargoTestExtraArg =",
        expect: "unknown argument(s) cargoTestExtraArg",
    },
    Control {
        name: "a list where a string is expected",
        file: "nix/iree-runtime.nix",
        from: "sourceRoot = pins.iree.source.subdir;",
        to: "sourceRoot = [ pins.iree.source.subdir ];",
        expect: "sourceRoot is a list",
    },
    Control {
        name: "a licence the flake's predicate refuses",
        file: "nix/lib.nix",
        from: "\"CUDA EULA\"",
        to: "\"CUDA-EULA\"",
        expect: "has an unfree license (‘CUDA EULA’)",
    },
    Control {
        name: "a missing attribute",
        file: "nix/iree-runtime.nix",
        from: "cudaPackages.cuda_cccl",
        to: "cudaPackages.cuda_ccl",
        expect: "attribute 'cuda_ccl' missing",
    },
    Control {
        name: "a CUDA wheel pinned at another version than nixpkgs'",
        file: "nix/pins.json",
        from: "\"version\": \"12.9.79\"",
        to: "\"version\": \"12.9.80\"",
        expect: "cuda_cudart is 12.9.79, the pin 12.9.80",
    },
];

/// Runs every control on x86_64-linux; returns what each printed.
pub fn run(checkout: &Checkout, work: &Path, inputs: &Inputs) -> Result<Value> {
    let mut results = Vec::new();
    for control in CONTROLS {
        let copy = work.join("control");
        checkout.copy_to(&copy)?;
        let file = copy.join(control.file);
        let text = std::fs::read_to_string(&file)?;
        if !text.contains(control.from) {
            return Err(anyhow!(
                "negative control `{}`: {} no longer contains {:?}; update crates/nix-harness/src/controls.rs",
                control.name,
                control.file,
                control.from
            ));
        }
        std::fs::write(&file, text.replacen(control.from, control.to, 1))?;
        let message = match evaluate_raw(checkout.root, &copy, inputs, Some("x86_64-linux"))? {
            Ok(_) => {
                return Err(anyhow!(
                    "negative control `{}` evaluated: the evaluation no longer catches it",
                    control.name
                ));
            }
            Err(message) => message,
        };
        let line = message
            .lines()
            .find(|l| l.contains(control.expect))
            .ok_or_else(|| {
                anyhow!(
                    "negative control `{}` failed for another reason (expected {:?}):\n{message}",
                    control.name,
                    control.expect
                )
            })?;
        eprintln!("refused  {:<42} {}", control.name, line.trim());
        results.push(json!({
            "name": control.name,
            "edit": format!("{}: {} -> {}", control.file, control.from, control.to),
            "error": line.trim(),
        }));
    }
    Ok(Value::Array(results))
}
