//! kiln-core
