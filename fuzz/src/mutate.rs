//! Structure-aware mutations. Most keep a file's framing and checksums consistent (a mutation
//! that only broke the CRC would be rejected before reaching anything interesting); a few work on
//! raw bytes so that framing itself is tested.

use serde_json::{json, Value};

use crate::container::{SafetensorsFile, TinyloopFile};
use crate::rng::Rng;
use crate::seeds;

/// Mutate a `.tinyloop` file: one to three stacked edits, or occasionally a fresh random model.
pub fn tinyloop(input: &[u8], rng: &mut Rng) -> Vec<u8> {
    if rng.below(16) == 0 {
        if let Some(fresh) = seeds::random_tinyloop(rng) {
            return fresh;
        }
    }
    let mut bytes = input.to_vec();
    for _ in 0..1 + rng.below(3) {
        bytes = match TinyloopFile::parse(&bytes) {
            Some(mut file) if rng.below(8) != 0 => {
                let ranges = file.tensor_ranges();
                match rng.below(8) {
                    0..=2 => data_bytes(&mut file.data, &ranges, rng),
                    3 => special_f16(&mut file.data, &ranges, rng),
                    4..=6 => header_number(&mut file.header, rng),
                    _ => header_structure(&mut file.header, rng),
                }
                // Keep checksums valid nine times in ten, so that later checks are reached.
                if rng.below(10) != 0 {
                    file.fix_checksums();
                }
                file.to_bytes()
            }
            _ => raw(&bytes, rng),
        };
    }
    bytes
}

/// Mutate a safetensors file (no checksums to keep).
pub fn safetensors(input: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut bytes = input.to_vec();
    for _ in 0..1 + rng.below(3) {
        bytes = match SafetensorsFile::parse(&bytes) {
            Some(mut file) if rng.below(8) != 0 => {
                let whole = [(0, file.data.len())];
                match rng.below(8) {
                    0 | 1 => data_bytes(&mut file.data, &whole, rng),
                    2 => special_f16(&mut file.data, &whole, rng),
                    3..=5 => header_number(&mut file.header, rng),
                    _ => header_structure(&mut file.header, rng),
                }
                file.to_bytes()
            }
            _ => raw(&bytes, rng),
        };
    }
    bytes
}

/// Change a few bytes inside tensor data.
fn data_bytes(data: &mut [u8], ranges: &[(usize, usize)], rng: &mut Rng) {
    for _ in 0..1 + rng.below(8) {
        let Some(at) = position_in(ranges, rng) else {
            return;
        };
        data[at] = match rng.below(3) {
            0 => rng.byte(),
            1 => data[at] ^ (1 << rng.below(8)),
            _ => data[at].wrapping_add(rng.byte() % 8).wrapping_sub(4),
        };
    }
}

/// Overwrite an aligned pair of bytes with an f16 edge value (NaN, ±Inf, the largest finite
/// values, subnormals, zeros).
fn special_f16(data: &mut [u8], ranges: &[(usize, usize)], rng: &mut Rng) {
    const VALUES: [u16; 12] = [
        0x7e00, 0x7c00, 0xfc00, 0x7bff, 0xfbff, 0x7000, 0x6000, 0x0001, 0x8001, 0x0000, 0x8000,
        0x3c00,
    ];
    let Some(at) = position_in(ranges, rng) else {
        return;
    };
    let at = at & !1;
    if at + 2 <= data.len() {
        data[at..at + 2].copy_from_slice(&rng.pick(&VALUES).to_le_bytes());
    }
}

/// A byte position inside one of `ranges`.
fn position_in(ranges: &[(usize, usize)], rng: &mut Rng) -> Option<usize> {
    let nonempty: Vec<_> = ranges.iter().filter(|(_, len)| *len > 0).collect();
    if nonempty.is_empty() {
        return None;
    }
    let (offset, len) = **rng.pick(&nonempty);
    Some(offset + rng.below(len))
}

/// JSON pointers to every leaf of `value` (numbers, strings, booleans, nulls).
fn leaves(value: &Value, path: String, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                leaves(
                    v,
                    format!("{path}/{}", key.replace('~', "~0").replace('/', "~1")),
                    out,
                );
            }
        }
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                leaves(v, format!("{path}/{i}"), out);
            }
        }
        _ => out.push(path),
    }
}

/// Replace a numeric field of the header with an edge value or a neighbour of its value.
fn header_number(header: &mut Value, rng: &mut Rng) {
    let mut paths = Vec::new();
    leaves(header, String::new(), &mut paths);
    paths.retain(|p| header.pointer(p).is_some_and(Value::is_number));
    if paths.is_empty() {
        return;
    }
    let path = rng.pick(&paths).clone();
    let old = header.pointer(&path).and_then(Value::as_u64).unwrap_or(1);
    let new = match rng.below(4) {
        0 => json!(old.wrapping_add(1)),
        1 => json!(old.saturating_sub(1)),
        2 => json!(old.wrapping_mul(1 + rng.below(4) as u64)),
        _ => interesting_number(rng),
    };
    if let Some(slot) = header.pointer_mut(&path) {
        *slot = new;
    }
}

fn interesting_number(rng: &mut Rng) -> Value {
    const UNSIGNED: [u64; 30] = [
        0,
        1,
        2,
        3,
        4,
        5,
        7,
        8,
        15,
        16,
        31,
        32,
        63,
        64,
        128,
        255,
        256,
        1023,
        1024,
        4096,
        65535,
        65536,
        1 << 24,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 32,
        1 << 53,
        1 << 63,
        u64::MAX,
    ];
    match rng.below(8) {
        0 => json!(*rng.pick(&[-1i64, -2, i64::MIN])),
        1 => json!(*rng.pick(&[0.5f64, 1e-300, 1e-30, 1e30, 1e300, -0.0, 2.5])),
        _ => json!(*rng.pick(&UNSIGNED)),
    }
}

/// Edit the header's structure: swap a string for another known one, delete a key, duplicate or
/// delete a list entry, add an unknown key, or change a value's type.
fn header_structure(header: &mut Value, rng: &mut Rng) {
    const STRINGS: [&str; 14] = [
        "f16",
        "f32",
        "int4",
        "int2",
        "bf16",
        "F32",
        "F16",
        "BF16",
        "I64",
        "rmsnorm",
        "layernorm",
        "tied",
        "untied",
        "",
    ];
    let mut paths = Vec::new();
    leaves(header, String::new(), &mut paths);
    if paths.is_empty() {
        return;
    }
    let path = rng.pick(&paths).clone();
    let parent = &path[..path.rfind('/').unwrap_or(0)];
    match rng.below(6) {
        0 => {
            if let Some(slot) = header.pointer_mut(&path) {
                *slot = json!(*rng.pick(&STRINGS));
            }
        }
        1 => match header.pointer_mut(parent) {
            Some(Value::Object(map)) => {
                let key = path[parent.len() + 1..]
                    .replace("~1", "/")
                    .replace("~0", "~");
                map.remove(&key);
            }
            Some(Value::Array(items)) if !items.is_empty() => {
                items.pop();
            }
            _ => {}
        },
        2 => {
            // Duplicate or delete a whole list entry (a tensor of the table, a dimension).
            let list = match header.pointer_mut(parent) {
                Some(Value::Array(items)) => Some(items),
                _ => header
                    .pointer_mut(&parent[..parent.rfind('/').unwrap_or(0)])
                    .and_then(Value::as_array_mut),
            };
            if let Some(items) = list.filter(|items| !items.is_empty()) {
                let i = rng.below(items.len());
                if rng.below(2) == 0 {
                    let copy = items[i].clone();
                    items.push(copy);
                } else {
                    items.remove(i);
                }
            }
        }
        3 => {
            if let Some(Value::Object(map)) = header.pointer_mut(parent) {
                map.insert("unexpected".into(), json!(1));
            }
        }
        4 => {
            if let Some(slot) = header.pointer_mut(&path) {
                *slot = rng
                    .pick(&[json!(null), json!(true), json!("7"), json!([]), json!({})])
                    .clone();
            }
        }
        _ => {
            // Copy one leaf's value over another (names, shapes and offsets of other tensors).
            let source = rng.pick(&paths).clone();
            let value = header.pointer(&source).cloned();
            if let (Some(value), Some(slot)) = (value, header.pointer_mut(&path)) {
                *slot = value;
            }
        }
    }
}

/// Byte-level edits anywhere: bit flips, overwrites, truncation, extension, insertion, deletion.
fn raw(input: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut bytes = input.to_vec();
    if bytes.is_empty() {
        bytes.push(rng.byte());
        return bytes;
    }
    match rng.below(6) {
        0 => {
            let at = rng.below(bytes.len());
            bytes[at] ^= 1 << rng.below(8);
        }
        1 => {
            for _ in 0..1 + rng.below(4) {
                let at = rng.below(bytes.len());
                bytes[at] = rng.byte();
            }
        }
        2 => bytes.truncate(rng.below(bytes.len())),
        3 => bytes.extend((0..1 + rng.below(256)).map(|_| rng.byte())),
        4 => {
            let at = rng.below(bytes.len());
            bytes.insert(at, rng.byte());
        }
        _ => {
            let at = rng.below(bytes.len());
            bytes.remove(at);
        }
    }
    bytes
}
