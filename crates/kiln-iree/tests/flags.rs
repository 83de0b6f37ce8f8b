//! IREE's process-wide flags through `set_flags`, in one test: the flags are
//! global, so the steps run in order in this binary of their own.

use kiln_iree::{Error, Instance, flags_in_effect, set_flags};

fn listing_has(line: &str) -> bool {
    flags_in_effect().unwrap().lines().any(|l| l == line)
}

#[test]
fn flags_are_kept_validated_and_fixed_while_a_device_is_open() {
    // IREE keeps a pointer into a string flag's text. Freed text is reused
    // by the next allocations of its size: fill those and the value read
    // back would be theirs.
    let flag = "--task_topology_performance_level=high";
    set_flags(&[flag]).unwrap();
    let scribbles: Vec<Vec<u8>> = (0..4096).map(|_| vec![b'x'; flag.len() + 1]).collect();
    assert!(
        listing_has("--task_topology_performance_level=\"high\""),
        "the flag's text did not outlive set_flags:\n{}",
        flags_in_effect().unwrap()
    );
    drop(scribbles);

    // A value IREE would read as 0, and an action flag that would exit the
    // process, are errors that change nothing.
    for (bad, expected) in [
        ("--task_worker_stack_size=notanumber", "an integer"),
        ("--help", "kiln does not take it"),
        ("--flagfile=/dev/null", "kiln does not take it"),
    ] {
        let error = set_flags(&[bad]).unwrap_err();
        assert!(matches!(error, Error::Flag { .. }), "{bad}: {error}");
        assert!(error.to_string().contains(expected), "{bad}: {error}");
    }
    assert!(listing_has("--task_worker_stack_size=131072"));
    assert!(listing_has("--task_topology_performance_level=\"high\""));

    // While a device exists the flags cannot change; the same ones are fine.
    set_flags(&["--task_worker_stack_size=262144"]).unwrap();
    let device = Instance::new().unwrap().device("local-sync").unwrap();
    assert!(matches!(
        set_flags(&["--task_worker_stack_size=65536"]),
        Err(Error::FlagsInUse { .. })
    ));
    set_flags(&["--task_worker_stack_size=262144"]).unwrap();
    drop(device);

    // A new set replaces the previous one: what it leaves out is back at
    // IREE's default.
    set_flags(&["--task_topology_mode=physical_cores"]).unwrap();
    assert!(listing_has("--task_worker_stack_size=131072"));
    assert!(listing_has("--task_topology_performance_level=\"any\""));

    // A scalar flag given twice takes its later value: kiln puts its own
    // defaults before the user's `--iree-flag`s.
    set_flags(&["--task_worker_spin_us=100", "--task_worker_spin_us=0"]).unwrap();
    assert!(listing_has("--task_worker_spin_us=0"));
    set_flags(&["--task_worker_spin_us=100"]).unwrap();
    assert!(listing_has("--task_worker_spin_us=100"));

    // IREE appends list flags and cannot clear them: once given, a list
    // can be repeated, not changed.
    set_flags(&["--task_topology_cpu_ids=0"]).unwrap();
    set_flags(&["--task_topology_cpu_ids=0"]).unwrap();
    let error = set_flags(&["--task_topology_cpu_ids=1"]).unwrap_err();
    assert!(error.to_string().contains("cannot be changed"), "{error}");
    assert!(listing_has("--task_topology_cpu_ids=0"));

    // The CUDA driver is built with kiln's patch (nix/iree-patches): its
    // graph replay is on unless turned off.
    #[cfg(feature = "cuda")]
    {
        assert!(
            listing_has("--cuda_replay_graphs=true"),
            "the IREE prefix lacks nix/iree-patches/cuda-graph-replay.patch:\n{}",
            flags_in_effect().unwrap()
        );
        set_flags(&["--task_topology_cpu_ids=0", "--cuda_replay_graphs=false"]).unwrap();
        assert!(listing_has("--cuda_replay_graphs=false"));
    }
}
