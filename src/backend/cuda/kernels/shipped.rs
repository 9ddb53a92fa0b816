//! Kernels shipped precompiled with the library, so that the first run on a common GPU needs no
//! NVRTC compile. `tinyloop kernels` (run by scripts/install and the Python wheel build) writes
//! one file per architecture into `tinyloop/kernels/` next to `libtinyloop.so`; [`find`] looks
//! there before the disk cache.
//!
//! The file name holds the architecture and the source hash but not the NVRTC version: the driver
//! loads a cubin whichever compiler made it. The content is the disk cache's format.

use std::ffi::{CStr, OsStr};
use std::mem::MaybeUninit;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use super::{cache_file, cache_key, compile, load_nvrtc, nvrtc_version, pack, store};
use super::{source_hash, unpack, KernelOptions};
use crate::env::Vars;
use crate::error::{Error, Result};

/// Where the shipped kernels live, relative to the folder of the library.
const SUBDIR: &str = "tinyloop/kernels";

fn file_name(arch: &str, defines: &[String]) -> String {
    format!("tinyloop-{arch}-{:016x}.cubin", source_hash(defines))
}

/// The cubins shipped for `arch` with these kernel sources and extra `defines`, and the file
/// they were read from.
pub(super) fn find(arch: &str, defines: &[String]) -> Option<(Vec<Vec<u8>>, PathBuf)> {
    find_in(&search_dirs(), arch, defines)
}

fn find_in(dirs: &[PathBuf], arch: &str, defines: &[String]) -> Option<(Vec<Vec<u8>>, PathBuf)> {
    let name = file_name(arch, defines);
    dirs.iter().find_map(|dir| {
        let path = dir.join(&name);
        let cubins = unpack(&std::fs::read(&path).ok()?)?;
        Some((cubins, path))
    })
}

/// `tinyloop/kernels` beside this library and beside the running program, and in `../lib` of
/// each: PREFIX/lib/libtinyloop.so and PREFIX/bin/tinyloop both find PREFIX/lib/tinyloop/kernels.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for file in [this_object(), std::env::current_exe().ok()]
        .into_iter()
        .flatten()
    {
        let Some(folder) = file.parent() else {
            continue;
        };
        for dir in [folder.join(SUBDIR), folder.join("../lib").join(SUBDIR)] {
            if !dirs.contains(&dir) {
                dirs.push(dir);
            }
        }
    }
    dirs
}

/// The file this code was loaded from (libtinyloop.so, or the program it is linked into), as
/// the dynamic loader names it; None when that is not an absolute path (the main program is
/// named by its argv[0], which `current_exe` resolves instead).
fn this_object() -> Option<PathBuf> {
    let mut info = MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables and fills `info` when it returns non-zero.
    let found = unsafe { libc::dladdr(this_object as *const libc::c_void, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so `info` is initialized.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: a non-null dli_fname is a NUL-terminated string owned by the loader, valid while
    // the object stays loaded (it contains this very function).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(OsStr::from_bytes(name.to_bytes()));
    path.is_absolute().then_some(path)
}

/// Compile every kernel program for `arch` (e.g. `sm_90`) with NVRTC and write the file that
/// [`find`] looks for into `dir`; returns its path. Cubins already in the disk cache for this
/// NVRTC are reused, and fresh ones are cached. The kernel variables of the process environment
/// apply as when a model opens.
pub fn ship(arch: &str, dir: &Path) -> Result<PathBuf> {
    let digits = arch.strip_prefix("sm_").unwrap_or_default();
    let digits = digits.strip_suffix('a').unwrap_or(digits);
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::invalid(format!(
            "architecture {arch:?}: expected sm_ and the compute capability, e.g. sm_90"
        )));
    }
    let KernelOptions { cache, defines } = KernelOptions::from_vars(Vars::process())?;
    load_nvrtc()?;
    let key = cache_key(arch, nvrtc_version()?, &defines);
    let cached = cache
        .as_ref()
        .and_then(|d| std::fs::read(cache_file(d, &key)).ok())
        .and_then(|bytes| unpack(&bytes));
    let cubins = match cached {
        Some(cubins) => cubins,
        None => {
            let cubins = compile(arch, &defines)?;
            if let Some(cache) = &cache {
                // A cache that cannot be written only costs a later compile.
                let _ = store(cache, &key, &pack(&cubins), None);
            }
            cubins
        }
    };
    let write = |path: &Path, bytes: &[u8]| {
        std::fs::write(path, bytes).map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        })
    };
    std::fs::create_dir_all(dir).map_err(|source| Error::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let name = file_name(arch, &defines);
    let path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    write(&tmp, &pack(&cubins))?;
    std::fs::rename(&tmp, &path).map_err(|source| Error::Write {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_name_holds_arch_and_source_hash_only() {
        assert_eq!(
            file_name("sm_90", &[]),
            format!("tinyloop-sm_90-{:016x}.cubin", source_hash(&[]))
        );
        assert_ne!(file_name("sm_80", &[]), file_name("sm_90", &[]));
    }

    #[test]
    fn search_covers_the_folder_of_this_object_and_its_lib_sibling() {
        let exe = std::env::current_exe().unwrap();
        let folder = exe.parent().unwrap();
        let dirs = search_dirs();
        assert!(dirs.contains(&folder.join(SUBDIR)), "{dirs:?}");
        assert!(
            dirs.contains(&folder.join("../lib").join(SUBDIR)),
            "{dirs:?}"
        );
    }

    #[test]
    fn shipped_file_is_found_and_unpacked() {
        let dir = std::env::temp_dir().join(format!("tinyloop-shipped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dirs = [dir.join("absent"), dir.clone()];
        let cubins: Vec<Vec<u8>> = (0..super::super::PROGRAMS.len())
            .map(|i| vec![i as u8; 3])
            .collect();
        let path = dir.join(file_name("sm_90", &[]));
        std::fs::write(&path, pack(&cubins)).unwrap();
        let found = find_in(&dirs, "sm_90", &[]);
        let other_arch = find_in(&dirs, "sm_80", &[]);
        let other_defines = find_in(&dirs, "sm_90", &["-DX".into()]);
        // A truncated file is not a shipped kernel set.
        std::fs::write(&path, &pack(&cubins)[..20]).unwrap();
        let truncated = find_in(&dirs, "sm_90", &[]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, Some((cubins, path)));
        assert_eq!(other_arch, None);
        assert_eq!(other_defines, None);
        assert_eq!(truncated, None);
    }

    #[test]
    fn ship_rejects_a_malformed_architecture() {
        for arch in ["90", "sm_", "sm_9", "sm_9x", "compute_90"] {
            let err = ship(arch, Path::new("/nonexistent")).unwrap_err();
            assert!(err.to_string().contains("expected sm_"), "{arch}: {err}");
        }
    }
}
