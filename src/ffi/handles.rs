//! The handles given to C: serial numbers under a random key, resolved through a process-wide
//! table of live objects, never addresses.
//!
//! A handle value is `MARK | kind | id` (kinds: model, session, prefix cache, resume handle,
//! engine).
//! Serial numbers come from one counter and are never reused, so a handle that was closed stays
//! closed for good: a later call is answered `TL_ERR_CLOSED` even when a new object of the same
//! kind exists. The id is the serial number through a keyed permutation whose key each kind
//! draws at random once per process, so ids are not consecutive and cannot be guessed: a value
//! near a real handle (± 1, a flipped bit, another kind's bits) decodes to a serial number that
//! was never issued and is refused as not a handle, instead of reaching another object. The
//! library never dereferences a handle value, so a stale, forged or mistyped handle is an error,
//! never a memory access; and since `MARK` is the top bit, no handle is a valid user-space
//! address on 64-bit targets (a caller that dereferences one faults at once, and no garbage
//! collector takes one for a pointer).
//!
//! Every entry point goes through [`Table::get`] (or [`Table::lookup`] for the close / free /
//! cancel functions, where a closed handle is not an error): the one place where a handle is
//! checked. The returned `Arc` keeps the object alive for the duration of the call, so closing
//! a handle in one thread while another thread is inside a call on it is safe.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, RandomState};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock, Weak};

use super::{tl_status, Failure, FfiResult};
use crate::error::Error;

/// Set in every handle value.
const MARK: usize = 1 << (usize::BITS - 1);
/// The three bits below `MARK` hold the kind.
const KIND_SHIFT: u32 = usize::BITS - 4;
/// The id part of a handle value.
const ID_MASK: usize = (1 << KIND_SHIFT) - 1;

/// The next serial number to hand out (shared by all kinds; 0 is never used).
static NEXT_SERIAL: AtomicUsize = AtomicUsize::new(1);

/// Odd multipliers of [`mix`] (splitmix64's, truncated to the word), and their inverses.
const M1: usize = 0x9E37_79B9_7F4A_7C15_u64 as usize;
const M2: usize = 0xBF58_476D_1CE4_E5B9_u64 as usize;
const M1_INV: usize = inverse(M1);
const M2_INV: usize = inverse(M2);

/// The inverse of an odd `m` modulo 2^usize::BITS, by Newton's iteration: `m · m ≡ 1 (mod 8)`,
/// and each step doubles the number of correct low bits (3, 6, …, 96).
const fn inverse(m: usize) -> usize {
    let mut inv = m;
    let mut step = 0;
    while step < 5 {
        inv = inv.wrapping_mul(2usize.wrapping_sub(m.wrapping_mul(inv)));
        step += 1;
    }
    inv
}

/// `x ^ (x >> s)` on id-wide values, s half the width rounded up: its own inverse, since no bit
/// is shifted twice. Folds the high bits (where a product spreads a change) into the low ones.
const fn fold(x: usize) -> usize {
    x ^ (x >> KIND_SHIFT.div_ceil(2))
}

/// A fixed permutation of id-wide values that scatters neighbouring inputs: multiply by an odd
/// constant, fold, twice (all modulo 2^KIND_SHIFT).
const fn mix(x: usize) -> usize {
    let x = fold(x.wrapping_mul(M1) & ID_MASK);
    fold(x.wrapping_mul(M2) & ID_MASK)
}

/// The inverse of [`mix`].
const fn unmix(x: usize) -> usize {
    let x = fold(x).wrapping_mul(M2_INV) & ID_MASK;
    fold(x).wrapping_mul(M1_INV) & ID_MASK
}

/// The kinds of handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Model,
    Session,
    PrefixCache,
    ResumeHandle,
    Engine,
}

impl Kind {
    const ALL: [Kind; 5] = [
        Kind::Model,
        Kind::Session,
        Kind::PrefixCache,
        Kind::ResumeHandle,
        Kind::Engine,
    ];

    fn code(self) -> usize {
        match self {
            Kind::Model => 0,
            Kind::Session => 1,
            Kind::PrefixCache => 2,
            Kind::ResumeHandle => 3,
            Kind::Engine => 4,
        }
    }

    fn bits(self) -> usize {
        MARK | self.code() << KIND_SHIFT
    }

    /// This kind's key for the process: two random id-wide words, drawn at first use.
    fn key(self) -> [usize; 2] {
        static KEYS: OnceLock<[[usize; 2]; 5]> = OnceLock::new();
        let keys = KEYS.get_or_init(|| {
            // Seeded from the operating system's random source.
            let random = RandomState::new();
            Kind::ALL.map(|kind| [0u8, 1].map(|i| random.hash_one((kind.code(), i)) as usize))
        });
        keys[self.code()].map(|word| word & ID_MASK)
    }

    /// The handle value of serial number `serial`.
    fn encode(self, serial: usize) -> usize {
        let [before, after] = self.key();
        self.bits() | (mix(serial ^ before) ^ after)
    }

    /// The serial number of a handle value of this kind. A value this kind never issued decodes
    /// to a scattered number, one that was issued with a chance of (serial numbers issued) /
    /// 2^60 on 64-bit targets.
    fn decode(self, value: usize) -> usize {
        let [before, after] = self.key();
        unmix((value & ID_MASK) ^ after) ^ before
    }

    /// The argument name used in messages ("model is NULL").
    pub fn arg(self) -> &'static str {
        match self {
            Kind::Model => "model",
            Kind::Session => "session",
            Kind::PrefixCache => "prefix_cache",
            Kind::ResumeHandle => "resume_handle",
            Kind::Engine => "engine",
        }
    }

    fn c_type(self) -> &'static str {
        match self {
            Kind::Model => "tl_model",
            Kind::Session => "tl_session",
            Kind::PrefixCache => "tl_prefix_cache",
            Kind::ResumeHandle => "tl_resume_handle",
            Kind::Engine => "tl_engine",
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
            Kind::Engine => {
                format!("{func} called on a freed engine; create a new one with tl_engine_new")
            }
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
        let serial = NEXT_SERIAL.fetch_add(1, Ordering::Relaxed);
        if serial > ID_MASK {
            // Only reachable where usize is 32 bits: 2^28 handles were issued.
            return Err(Failure::new(
                tl_status::TL_ERR_OUT_OF_MEMORY,
                "no handle ids left in this process",
            ));
        }
        let mut live = self.live.write().unwrap_or_else(|p| p.into_inner());
        live.insert(serial, Arc::new_cyclic(make));
        Ok(std::ptr::without_provenance_mut(self.kind.encode(serial)))
    }

    /// Classify a handle value. Takes the table's read lock only.
    pub fn lookup(&self, handle: *const C) -> Lookup<T> {
        let value = handle.addr();
        if value == 0 {
            return Lookup::Null;
        }
        let kind = self.kind;
        match issued(value) {
            Some((found, serial)) if found == kind => {
                let live = self.live.read().unwrap_or_else(|p| p.into_inner());
                match live.get(&serial) {
                    Some(object) => Lookup::Live(Arc::clone(object)),
                    None => Lookup::Closed,
                }
            }
            found => {
                let what = match found {
                    Some((other, _)) => format!("a {} handle", other.c_type()),
                    None => format!("not a handle ({value:#x})"),
                };
                Lookup::Invalid(Failure::invalid(format!(
                    "{} is {what}, not a {}",
                    kind.arg(),
                    kind.c_type()
                )))
            }
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
        live.remove(&self.kind.decode(handle.addr()));
    }

    /// How many handles of this kind are live.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.live.read().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// The kind and serial number of a handle value that this process issued (closed or not);
/// `None` for any other value.
fn issued(value: usize) -> Option<(Kind, usize)> {
    let kind = Kind::ALL
        .into_iter()
        .find(|kind| value & !ID_MASK == kind.bits())?;
    let serial = kind.decode(value);
    (serial != 0 && serial < NEXT_SERIAL.load(Ordering::Relaxed)).then_some((kind, serial))
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
    fn the_id_permutation_is_invertible() {
        assert_eq!(M1.wrapping_mul(M1_INV), 1);
        assert_eq!(M2.wrapping_mul(M2_INV), 1);
        for x in [0, 1, 2, 12345, ID_MASK / 3, ID_MASK - 1, ID_MASK] {
            assert_eq!(unmix(mix(x)), x, "{x:#x}");
            assert_eq!(mix(unmix(x)), x, "{x:#x}");
            assert!(mix(x) <= ID_MASK);
        }
        for kind in Kind::ALL {
            for serial in [1, 2, 3, ID_MASK] {
                assert_eq!(kind.decode(kind.encode(serial)), serial);
            }
        }
    }

    /// Ids are scattered, and a value next to a handle (± 1, a flipped bit, the kind bits of
    /// another kind) is not a handle, whether that handle is live or closed. Each check fails
    /// by chance with a probability of about 2^-40 (two random 60-bit ids within 2^20 of each
    /// other) or below (a scattered value hitting one of the few issued serial numbers).
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn ids_are_scattered_and_values_next_to_a_handle_are_refused() {
        let models: Table<u32, Model> = Table::new(Kind::Model);
        let handles: Vec<_> = (0..32).map(|i| models.insert(i).unwrap()).collect();
        for pair in handles.windows(2) {
            let gap = pair[0].addr().abs_diff(pair[1].addr());
            assert!(gap > 1 << 20, "{:?} and {:?} are close", pair[0], pair[1]);
        }
        models.remove(handles[0]);
        assert!(matches!(models.lookup(handles[0]), Lookup::Closed));
        for &handle in &handles {
            let value = handle.addr();
            let other_kind = value ^ (1 << KIND_SHIFT);
            for forged in [
                value + 1,
                value - 1,
                value ^ 1,
                value ^ (1 << 40),
                other_kind,
            ] {
                let forged = std::ptr::without_provenance::<Model>(forged);
                match models.lookup(forged) {
                    Lookup::Invalid(f) => {
                        assert!(f.message.contains("not a handle"), "{}", f.message)
                    }
                    _ => panic!("{forged:?}, next to the handle {handle:?}, was accepted"),
                }
            }
        }
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
