//! Allocation whose size comes from a file or a caller: failure is an error naming the true size,
//! never an abort.

use crate::error::{Error, Result};

/// An empty vector with room for `len` values.
pub(crate) fn with_capacity<T>(len: usize, what: &str) -> Result<Vec<T>> {
    let Some(bytes) = len.checked_mul(std::mem::size_of::<T>()) else {
        return Err(Error::invalid(format!(
            "{what}: {len} values of {} bytes exceed the address space",
            std::mem::size_of::<T>()
        )));
    };
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| Error::OutOfMemory {
        bytes,
        what: what.to_string(),
    })?;
    Ok(v)
}

/// A vector of `len` default values.
pub(crate) fn zeroed<T: Clone + Default>(len: usize, what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(len, what)?;
    v.resize(len, T::default());
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_errors_naming_the_true_size() {
        let err = zeroed::<f32>(1 << 60, "a test table").unwrap_err();
        match err {
            Error::OutOfMemory { bytes, what } => {
                assert_eq!(bytes, 1 << 62);
                assert_eq!(what, "a test table");
            }
            other => panic!("{other:?}"),
        }
        let err = with_capacity::<u64>(usize::MAX / 2, "x").unwrap_err();
        assert!(
            err.to_string().contains("exceed the address space"),
            "{err}"
        );
    }
}
