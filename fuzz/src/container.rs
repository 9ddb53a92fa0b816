//! The two file layouts taken apart into header JSON and data, so that mutations can edit fields
//! and put the file back together with consistent lengths and checksums.

use serde_json::Value;

/// A `.tinyloop` file: magic, version and flags; the header; the data section.
pub struct TinyloopFile {
    pub preamble: [u8; 16],
    pub header: Value,
    pub data: Vec<u8>,
}

impl TinyloopFile {
    /// `None` when the bytes do not even have a readable header.
    pub fn parse(bytes: &[u8]) -> Option<TinyloopFile> {
        let preamble: [u8; 16] = bytes.get(..16)?.try_into().ok()?;
        let len = u64::from_le_bytes(bytes.get(16..24)?.try_into().ok()?);
        let end = 24usize.checked_add(usize::try_from(len).ok()?)?;
        let header = serde_json::from_slice(bytes.get(24..end)?).ok()?;
        let data_start = end.div_ceil(64) * 64;
        let data = bytes.get(data_start..).unwrap_or_default().to_vec();
        Some(TinyloopFile {
            preamble,
            header,
            data,
        })
    }

    /// `(offset, length)` of every tensor whose range lies inside the data section.
    pub fn tensor_ranges(&self) -> Vec<(usize, usize)> {
        let Some(tensors) = self.header["tensors"].as_array() else {
            return Vec::new();
        };
        tensors
            .iter()
            .filter_map(|t| {
                let offset = usize::try_from(t["offset"].as_u64()?).ok()?;
                let length = usize::try_from(t["length"].as_u64()?).ok()?;
                (offset.checked_add(length)? <= self.data.len()).then_some((offset, length))
            })
            .collect()
    }

    /// Recompute the checksum of every tensor whose range lies inside the data section.
    pub fn fix_checksums(&mut self) {
        let data = &self.data;
        // Mutations can turn the header or any entry into a non-object: indexing a JSON value
        // for writing would panic on those, so only objects are touched.
        let Some(tensors) = self.header.get_mut("tensors").and_then(Value::as_array_mut) else {
            return;
        };
        for t in tensors.iter_mut().filter_map(Value::as_object_mut) {
            let (Some(offset), Some(length)) = (
                t.get("offset").and_then(Value::as_u64),
                t.get("length").and_then(Value::as_u64),
            ) else {
                continue;
            };
            let range = usize::try_from(offset)
                .ok()
                .zip(usize::try_from(length).ok())
                .and_then(|(o, l)| Some(o..o.checked_add(l)?));
            if let Some(bytes) = range.and_then(|r| data.get(r)) {
                t.insert("crc32".into(), crc32fast::hash(bytes).into());
            }
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(&self.header).expect("a JSON value serializes");
        let mut out = self.preamble.to_vec();
        out.extend((json.len() as u64).to_le_bytes());
        out.extend(&json);
        out.resize(out.len().div_ceil(64) * 64, 0);
        out.extend(&self.data);
        out
    }
}

/// A safetensors file: the header JSON (tensor name → dtype, shape, data offsets) and the data.
pub struct SafetensorsFile {
    pub header: Value,
    pub data: Vec<u8>,
}

impl SafetensorsFile {
    pub fn parse(bytes: &[u8]) -> Option<SafetensorsFile> {
        let len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let end = 8usize.checked_add(usize::try_from(len).ok()?)?;
        let header = serde_json::from_slice(bytes.get(8..end)?).ok()?;
        Some(SafetensorsFile {
            header,
            data: bytes[end..].to_vec(),
        })
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let json = serde_json::to_vec(&self.header).expect("a JSON value serializes");
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend(&json);
        out.extend(&self.data);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: Value) -> TinyloopFile {
        TinyloopFile {
            preamble: [0; 16],
            header,
            data: vec![1, 2, 3, 4],
        }
    }

    #[test]
    fn checksums_are_fixed_in_objects_and_other_values_are_left_alone() {
        for header in [
            serde_json::json!(5),
            serde_json::json!({"tensors": 5}),
            serde_json::json!({"tensors": [1, "x", null]}),
        ] {
            let mut f = file(header.clone());
            f.fix_checksums();
            assert_eq!(f.header, header);
        }
        let mut f = file(serde_json::json!({"tensors": [7, {"offset": 1, "length": 2}]}));
        f.fix_checksums();
        let expected = u64::from(crc32fast::hash(&[2, 3]));
        assert_eq!(f.header["tensors"][1]["crc32"], expected);
        assert_eq!(f.header["tensors"][0], 7);
    }
}
