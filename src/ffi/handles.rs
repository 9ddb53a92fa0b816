//! The handles given to C: serial numbers, resolved through a process-wide table of live
//! objects, never addresses.
//!
//! A handle value is `MARK | kind | id` (kinds: model, session, prefix cache, resume handle). Ids come from one counter and are never reused, so a
//! handle that was closed stays closed for good: a later call is answered `TL_ERR_CLOSED`
//! even when a new object of the same kind exists. The library never dereferences a handle
//! value, so a stale, forged or mistyped handle is an error, never a memory access; and since
//! `MARK` is the top bit, no handle is a valid user-space address on 64-bit targets (a caller
//! that dereferences one faults at once, and no garbage collector takes one for a pointer).
//!
//! Every entry point goes through [`Table::get`] (or [`Table::lookup`] for the close / free /
//! cancel functions, where a closed handle is not an error): the one place where a handle is
//! checked. The returned `Arc` keeps the object alive for the duration of the call, so closing
//! a handle in one thread while another thread is inside a call on it is safe.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock, Weak};

use super::{tl_status, Failure, FfiResult};
use crate::error::Error;

/// Set in every handle value.
const MARK: usize = 1 << (usize::BITS - 1);
/// The two bits below `MARK` hold the kind.
const KIND_SHIFT: u32 = usize::BITS - 3;
/// The id part of a handle value.
const ID_MASK: usize = (1 << KIND_SHIFT) - 1;

/// The next id to hand out (shared by all kinds; 0 is never used).
static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// The kinds of handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Model,
    Session,
    PrefixCache,
    ResumeHandle,
}

impl Kind {
    const ALL: [Kind; 4] = [
        Kind::Model,
        Kind::Session,
        Kind::PrefixCache,
        Kind::ResumeHandle,
    ];

    fn bits(self) -> usize {
        let code = match self {
            Kind::Model => 0,
            Kind::Session => 1,
            Kind::PrefixCache => 2,
            Kind::ResumeHandle => 3,
        };
        MARK | code << KIND_SHIFT
    }

    /// The argument name used in messages ("model is NULL").
    pub fn arg(self) -> &'static str {
        match self {
            Kind::Model => "model",
            Kind::Session => "session",
            Kind::PrefixCache => "prefix_cache",
            Kind::ResumeHandle => "resume_handle",
        }
    }

    fn c_type(self) -> &'static str {
        match self {
            Kind::Model => "tl_model",
            Kind::Session => "tl_session",
            Kind::PrefixCache => "tl_prefix_cache",
            Kind::ResumeHandle => "tl_resume_handle",
        }
    }

    /// The failure of `func` called on a handle of this kind that was closed / freed.
    pub fn closed(self, func: &str) -> Failure {
        let message = match self {
            Kind::Model => return Failure::from(Error::Closed(func.to_string())),
            Kind::Session => {
                format!("{func} called on a freed session; create a new one with tl_session_new")
            }
            Kind::PrefixCache => format!(
                "{func} called with a prefix cache that was freed or whose model was closed; \
                 build a new one with tl_prefix_cache_new"
            ),
            Kind::ResumeHandle => format!(
                "{func} called with a resume handle that was freed or whose model was closed; \
                 build a new one with tl_resume_handle_new"
            ),
        };
        Failure::new(tl_status::TL_ERR_CLOSED, message)
    }
}

/// What a handle value refers to.
pub(crate) enum Lookup<T> {
    Null,
    Live(Arc<T>),
    /// A handle of this kind that was closed (it stays closed: ids are never reused).
    Closed,
    /// Not a handle of this kind; the failure says what it is instead.
    Invalid(Failure),
}

/// The live objects behind the handles of one kind; `C` is the opaque C type of the handle.
pub(crate) struct Table<T, C> {
    kind: Kind,
    live: RwLock<BTreeMap<usize, Arc<T>>>,
    handle_type: PhantomData<fn() -> C>,
}

impl<T, C> Table<T, C> {
    pub const fn new(kind: Kind) -> Self {
        Table {
            kind,
            live: RwLock::new(BTreeMap::new()),
            handle_type: PhantomData,
        }
    }

    /// Register `value` and return its new handle.
    pub fn insert(&self, value: T) -> FfiResult<*mut C> {
        self.insert_cyclic(|_| value)
    }

    /// Register the object `make` builds from a weak reference to itself, and return its new
    /// handle.
    pub fn insert_cyclic(&self, make: impl FnOnce(&Weak<T>) -> T) -> FfiResult<*mut C> {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        if id > ID_MASK {
            // Only reachable where usize is 32 bits: 2^30 handles were issued.
            return Err(Failure::new(
                tl_status::TL_ERR_OUT_OF_MEMORY,
                "no handle ids left in this process",
            ));
        }
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        live.insert(id, Arc::new_cyclic(make));
        Ok(std::ptr::without_provenance_mut(self.kind.bits() | id))
    }

    /// Classify a handle value. Takes the table's read lock only.
    pub fn lookup(&self, handle: *const C) -> Lookup<T> {
        let value = handle.addr();
        if value == 0 {
            return Lookup::Null;
        }
        let kind = self.kind;
        let id = value & ID_MASK;
        if value & !ID_MASK != kind.bits() || id == 0 || id >= NEXT_ID.load(Ordering::Relaxed) {
            let other = Kind::ALL
                .into_iter()
                .find(|&k| k != kind && value & !ID_MASK == k.bits());
            let what = match other {
                Some(other) => format!("a {} handle", other.c_type()),
                None => format!("not a handle ({value:#x})"),
            };
            return Lookup::Invalid(Failure::invalid(format!(
                "{} is {what}, not a {}",
                kind.arg(),
                kind.c_type()
            )));
        }
        let live = self.live.read().unwrap_or_else(|p| p.into_inner());
        match live.get(&id) {
            Some(object) => Lookup::Live(Arc::clone(object)),
            None => Lookup::Closed,
        }
    }

    /// The object behind a handle that `func` was called on: `TL_ERR_INVALID_ARGUMENT` for NULL
    /// or a value that is not a handle of this kind, `TL_ERR_CLOSED` for a closed one.
    pub fn get(&self, handle: *const C, func: &str) -> FfiResult<Arc<T>> {
        match self.lookup(handle) {
            Lookup::Live(object) => Ok(object),
            Lookup::Null => Err(Failure::invalid(format!("{} is NULL", self.kind.arg()))),
            Lookup::Closed => Err(self.kind.closed(func)),
            Lookup::Invalid(failure) => Err(failure),
        }
    }

    /// Unregister a handle: later lookups say `Closed`. The object is dropped when the last
    /// call still holding it returns.
    pub fn remove(&self, handle: *const C) {
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        live.remove(&(handle.addr() & ID_MASK));
    }

    /// How many handles of this kind are live.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.live.read().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Model;
    struct Session;

    #[test]
    fn handles_are_never_reused_and_never_addresses() {
        let models: Table<u32, Model> = Table::new(Kind::Model);
        let a = models.insert(1).unwrap();
        assert!(matches!(models.lookup(a), Lookup::Live(v) if *v == 1));
        models.remove(a);
        assert!(matches!(models.lookup(a), Lookup::Closed));
        let b = models.insert(2).unwrap();
        assert_ne!(a, b, "a closed handle's value is not handed out again");
        assert!(matches!(models.lookup(a), Lookup::Closed));
        assert!(matches!(models.lookup(b), Lookup::Live(v) if *v == 2));
        assert_ne!(b.addr() & MARK, 0);
        assert_eq!(models.len(), 1);
    }

    #[test]
    fn wrong_kind_forged_and_null_values_are_named() {
        let models: Table<u32, Model> = Table::new(Kind::Model);
        let sessions: Table<u32, Session> = Table::new(Kind::Session);
        let s = sessions.insert(7).unwrap();
        let as_model = s.cast::<Model>();
        let message = |l: Lookup<u32>| match l {
            Lookup::Invalid(f) => {
                assert_eq!(f.status, tl_status::TL_ERR_INVALID_ARGUMENT);
                f.message
            }
            _ => panic!("not invalid"),
        };
        assert_eq!(
            message(models.lookup(as_model)),
            "model is a tl_session handle, not a tl_model"
        );
        let heap = Box::new(0u64);
        let address = (&*heap as *const u64).cast::<Model>();
        assert!(message(models.lookup(address)).starts_with("model is not a handle (0x"));
        let never_issued = std::ptr::without_provenance::<Model>(MARK | ID_MASK);
        assert!(message(models.lookup(never_issued)).contains("not a handle"));
        assert!(matches!(models.lookup(std::ptr::null()), Lookup::Null));
        let closed = models.get(std::ptr::null(), "tl_generate").unwrap_err();
        assert_eq!(closed.message, "model is NULL");
    }

    #[test]
    fn closed_failures_name_the_function_and_the_kind() {
        for (kind, func, start) in [
            (
                Kind::Model,
                "tl_generate",
                "tl_generate called on a closed model",
            ),
            (Kind::Session, "f", "f called on a freed session"),
        ] {
            let failure = kind.closed(func);
            assert_eq!(failure.status, tl_status::TL_ERR_CLOSED);
            assert!(failure.message.starts_with(start), "{}", failure.message);
        }
    }
}
