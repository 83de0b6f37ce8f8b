//! kiln-xla
