//! The C ABI (see docs/ABI.md).
