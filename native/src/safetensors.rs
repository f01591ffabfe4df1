//! The safetensors container, read from its public definition: an 8-byte little-endian
//! header length N, N bytes of JSON (`name -> {dtype, shape, data_offsets}` plus an
//! optional `__metadata__` string map), then the data section the offsets point into.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value;

use crate::json;

/// Element types a safetensors header may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub fn parse(name: &str) -> Option<Dtype> {
        Some(match name {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "F8_E5M2" => Dtype::F8E5M2,
            "F8_E4M3" => Dtype::F8E4M3,
            "I16" => Dtype::I16,
            "U16" => Dtype::U16,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            "I32" => Dtype::I32,
            "U32" => Dtype::U32,
            "F32" => Dtype::F32,
            "F64" => Dtype::F64,
            "I64" => Dtype::I64,
            "U64" => Dtype::U64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E5M2 | Dtype::F8E4M3 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
        }
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor's header entry; `begin..end` is relative to the data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub begin: usize,
    pub end: usize,
}

/// A parsed header: tensors by name, the `__metadata__` map, and where data starts.
#[derive(Debug, Default)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    pub data_start: usize,
}

impl Header {
    /// Parses and validates the header of a whole safetensors file held in `bytes`:
    /// known dtypes, byte ranges that match `shape x dtype`, and ranges that tile the
    /// data section exactly (no gap, no overlap, nothing after the last tensor).
    /// `max_header_len` caps N, the JSON header's length.
    pub fn parse(bytes: &[u8], max_header_len: u64) -> Result<Header, String> {
        if bytes.len() < 8 {
            return Err(format!(
                "file is {} bytes, shorter than the 8-byte header length",
                bytes.len()
            ));
        }
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        if header_len > max_header_len {
            return Err(format!(
                "header length {header_len} exceeds {max_header_len} bytes"
            ));
        }
        let data_start = 8 + header_len as usize;
        if data_start > bytes.len() {
            return Err(format!(
                "header length {header_len} runs past the end of the {}-byte file",
                bytes.len()
            ));
        }
        let text = std::str::from_utf8(&bytes[8..data_start])
            .map_err(|e| format!("header is not UTF-8: {e}"))?;
        let json =
            json::parse_strict(text).map_err(|e| format!("header is not valid JSON: {e}"))?;
        let entries = json.as_object().ok_or("header is not a JSON object")?;

        let mut header = Header {
            data_start,
            ..Header::default()
        };
        for (name, entry) in entries {
            if name == "__metadata__" {
                header.metadata = parse_metadata(entry)?;
            } else if name.is_empty() {
                return Err("a tensor entry has an empty name".into());
            } else {
                let info = parse_entry(entry).map_err(|e| format!("tensor {name}: {e}"))?;
                header.tensors.insert(name.clone(), info);
            }
        }
        header.check_layout(bytes.len() - data_start)?;
        Ok(header)
    }

    fn check_layout(&self, data_len: usize) -> Result<(), String> {
        let mut ranges: Vec<(usize, usize, &str)> = self
            .tensors
            .iter()
            .map(|(n, t)| (t.begin, t.end, n.as_str()))
            .collect();
        ranges.sort();
        let mut cursor = 0;
        for (begin, end, name) in ranges {
            if begin != cursor {
                return Err(format!(
                    "tensor {name}: data starts at {begin}, expected {cursor} (gap or overlap)"
                ));
            }
            cursor = end;
        }
        if cursor != data_len {
            return Err(format!(
                "tensors cover {cursor} data bytes but the file holds {data_len}"
            ));
        }
        Ok(())
    }
}

fn parse_metadata(value: &Value) -> Result<BTreeMap<String, String>, String> {
    let map = value.as_object().ok_or("__metadata__ is not an object")?;
    map.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(format!("__metadata__ value for {k} is not a string")),
        })
        .collect()
}

fn parse_entry(value: &Value) -> Result<TensorInfo, String> {
    let fields = value.as_object().ok_or("entry is not an object")?;
    if let Some(extra) = fields
        .keys()
        .find(|k| !["dtype", "shape", "data_offsets"].contains(&k.as_str()))
    {
        return Err(format!(
            "unexpected field {extra:?} (an entry holds dtype, shape, data_offsets)"
        ));
    }
    let dtype_name = value
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or("missing string dtype")?;
    let dtype = Dtype::parse(dtype_name).ok_or_else(|| format!("unknown dtype {dtype_name}"))?;
    let shape = usize_list(value.get("shape"), "shape")?;
    let offsets = usize_list(value.get("data_offsets"), "data_offsets")?;
    let [begin, end] = offsets[..] else {
        return Err(format!(
            "data_offsets has {} entries, expected 2",
            offsets.len()
        ));
    };
    if end < begin {
        return Err(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        ));
    }
    let nbytes = shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or("shape overflows")?;
    if end - begin != nbytes {
        return Err(format!(
            "data_offsets span {} bytes but shape {shape:?} of {dtype} needs {nbytes}",
            end - begin
        ));
    }
    Ok(TensorInfo {
        dtype,
        shape,
        begin,
        end,
    })
}

fn usize_list(value: Option<&Value>, field: &str) -> Result<Vec<usize>, String> {
    let items = value
        .and_then(Value::as_array)
        .ok_or_else(|| format!("missing list {field}"))?;
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .map(|n| n as usize)
                .ok_or_else(|| format!("{field} holds {v}, expected a non-negative integer"))
        })
        .collect()
}

/// A safetensors file mapped into memory with its parsed header.
pub struct MappedFile {
    mmap: Mmap,
    pub header: Header,
}

impl MappedFile {
    pub fn open(path: &Path, max_header_len: u64) -> Result<MappedFile, String> {
        let file = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
        let len = file
            .metadata()
            .map_err(|e| format!("cannot stat: {e}"))?
            .len();
        if len < 8 {
            // mmap cannot map an empty file; report the short file like any other.
            return Err(format!(
                "file is {len} bytes, shorter than the 8-byte header length"
            ));
        }
        // SAFETY: the export is read-only input; nothing in this process writes the file.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| format!("cannot memory-map: {e}"))?;
        let header = Header::parse(&mmap, max_header_len)?;
        Ok(MappedFile { mmap, header })
    }

    /// The raw little-endian bytes of one tensor.
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        let start = self.header.data_start;
        &self.mmap[start + info.begin..start + info.end]
    }

    /// The whole tensor as f32 (exact for BF16, F16 and F32).
    pub fn to_f32(&self, info: &TensorInfo) -> Result<Vec<f32>, String> {
        decode_f32(info.dtype, self.bytes(info))
    }

    /// Row `row` of a tensor viewed as `[shape[0], rest]`, as f32, without decoding the rest.
    pub fn row_f32(&self, info: &TensorInfo, row: usize) -> Result<Vec<f32>, String> {
        let rows = *info.shape.first().ok_or("a 0-d tensor has no rows")?;
        if row >= rows {
            return Err(format!("row {row} out of range for {rows} rows"));
        }
        let row_bytes = (info.end - info.begin) / rows;
        decode_f32(
            info.dtype,
            &self.bytes(info)[row * row_bytes..(row + 1) * row_bytes],
        )
    }
}

/// Index of the first NaN or infinity in little-endian floating-point bytes, if any.
pub fn first_non_finite(dtype: Dtype, bytes: &[u8]) -> Option<usize> {
    // Non-finite means an all-ones exponent field.
    match dtype {
        Dtype::F32 => bytes.chunks_exact(4).position(|b| {
            u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7f80_0000 == 0x7f80_0000
        }),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 == 0x7f80),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .position(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7c00 == 0x7c00),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .position(|b| !f64::from_le_bytes(b.try_into().unwrap()).is_finite()),
        _ => None,
    }
}

/// Decodes little-endian floating-point bytes to f32; BF16 and F16 widen exactly.
pub fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, String> {
    Ok(match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(format!("cannot read {other} as floating point")),
    })
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// Builds safetensors bytes from `(name, dtype, shape, data)` in the given order.
    pub fn build(tensors: &[(&str, &str, &[usize], &[u8])], metadata: Option<Value>) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        if let Some(m) = metadata {
            header.insert("__metadata__".into(), m);
        }
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let begin = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        let text = Value::Object(header).to_string();
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(&data);
        out
    }

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn parses_tensors_and_metadata() {
        let a = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let b = [0x80u8, 0x3f]; // BF16 1.0, little-endian
        let bytes = build(
            &[("a", "F32", &[2, 3], &a), ("b", "BF16", &[1], &b)],
            Some(serde_json::json!({"format": "pt"})),
        );
        let header = Header::parse(&bytes, 1 << 20).unwrap();
        assert_eq!(header.metadata["format"], "pt");
        let info = &header.tensors["a"];
        assert_eq!(
            (info.dtype, info.shape.clone(), info.begin, info.end),
            (Dtype::F32, vec![2, 3], 0, 24)
        );
        assert_eq!(header.tensors["b"].begin, 24);
        let data = &bytes[header.data_start..];
        assert_eq!(decode_f32(Dtype::F32, &data[0..24]).unwrap()[5], 6.0);
        assert_eq!(decode_f32(Dtype::BF16, &data[24..26]).unwrap(), vec![1.0]);
    }

    #[test]
    fn decodes_bf16_and_f16_exactly() {
        // -2.5 is 0xC020 in BF16 and 0xC100 in F16.
        assert_eq!(decode_f32(Dtype::BF16, &[0x20, 0xc0]).unwrap(), vec![-2.5]);
        assert_eq!(decode_f32(Dtype::F16, &[0x00, 0xc1]).unwrap(), vec![-2.5]);
        assert!(decode_f32(Dtype::I32, &[0; 4]).is_err());
    }

    #[test]
    fn refuses_size_mismatch() {
        let bytes = build(&[("a", "F32", &[2], &[0u8; 4])], None);
        let err = Header::parse(&bytes, 1 << 20).unwrap_err();
        assert!(err.contains("tensor a") && err.contains("needs 8"), "{err}");
    }

    #[test]
    fn refuses_unknown_dtype_and_trailing_bytes() {
        let bytes = build(&[("", "F32", &[1], &[0u8; 4])], None);
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("empty name"));
        let bytes = build(&[("a", "F12", &[1], &[0u8; 4])], None);
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("unknown dtype F12"));
        let mut bytes = build(&[("a", "F32", &[1], &[0u8; 4])], None);
        bytes.push(0);
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("file holds 5"));
    }

    #[test]
    fn refuses_extra_entry_fields_repeated_keys_and_big_headers() {
        let text = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}"#;
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.push(0);
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("unexpected field \"x\""));
        assert!(Header::parse(&bytes, 16)
            .unwrap_err()
            .contains("exceeds 16"));
        let text = r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.push(0);
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("repeated key"));
    }

    #[test]
    fn finds_non_finite_values() {
        let f32s = f32_bytes(&[1.0, f32::MAX, f32::INFINITY]);
        assert_eq!(first_non_finite(Dtype::F32, &f32s), Some(2));
        assert_eq!(
            first_non_finite(Dtype::F32, &f32_bytes(&[0.0, -0.0, f32::MIN])),
            None
        );
        // BF16: 0x7f7f is the largest finite value, 0x7fc0 a NaN, 0xff80 -inf.
        assert_eq!(
            first_non_finite(Dtype::BF16, &[0x7f, 0x7f, 0xc0, 0x7f]),
            Some(1)
        );
        assert_eq!(first_non_finite(Dtype::BF16, &[0x80, 0xff]), Some(0));
    }

    #[test]
    fn refuses_truncated_header() {
        assert!(Header::parse(&[1, 0, 0], 1 << 20).is_err());
        let mut bytes = 1000u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("past the end"));
    }

    #[test]
    fn refuses_overlapping_ranges() {
        let text = r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}"#;
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(text.as_bytes());
        bytes.extend_from_slice(&[0; 3]);
        assert!(Header::parse(&bytes, 1 << 20)
            .unwrap_err()
            .contains("gap or overlap"));
    }
}
