//! Observability of generation calls: BETA-MON ([`beta_monitor`]), the next-token entropy and
//! draft/verify agreement of each call.

pub mod beta_monitor;
