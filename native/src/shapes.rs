//! The tensor tables of export-format §4-§7: every expected name with its shape, computed
//! from `config.json` (dtypes are fixed per file: language/vision BF16, adapter/head F32).

use std::collections::BTreeMap;

use crate::config::{Config, LayerType};
use crate::report::Problems;
use crate::safetensors::{Dtype, Header, TensorInfo};

pub const LANGUAGE_PREFIX: &str = "model.language_model.";
pub const VISION_PREFIX: &str = "model.visual.";
pub const ADAPTER_PREFIX: &str = "base_model.model.";

/// Expected tensors of one file: name -> shape.
pub type Table = BTreeMap<String, Vec<usize>>;

/// One tensor of a language layer, named after `layers.{i}.`.
struct LayerTensor {
    suffix: &'static str,
    shape: Vec<usize>,
    lora_target: bool,
}

fn layer_tensors(cfg: &Config, layer_type: LayerType) -> Vec<LayerTensor> {
    let t = &cfg.text;
    let h = t.hidden_size;
    let entry = |suffix, shape: &[usize], lora_target| LayerTensor {
        suffix,
        shape: shape.to_vec(),
        lora_target,
    };
    let mut tensors = vec![
        entry("input_layernorm.weight", &[h], false),
        entry("post_attention_layernorm.weight", &[h], false),
    ];
    match layer_type {
        LayerType::Linear => {
            let heads = t.linear_num_value_heads;
            tensors.extend([
                entry("linear_attn.in_proj_qkv.weight", &[cfg.conv_dim(), h], true),
                entry("linear_attn.in_proj_z.weight", &[cfg.value_dim(), h], true),
                entry("linear_attn.in_proj_b.weight", &[heads, h], true),
                entry("linear_attn.in_proj_a.weight", &[heads, h], true),
                entry("linear_attn.out_proj.weight", &[h, cfg.value_dim()], true),
                entry(
                    "linear_attn.conv1d.weight",
                    &[cfg.conv_dim(), 1, t.linear_conv_kernel_dim],
                    false,
                ),
                entry("linear_attn.A_log", &[heads], false),
                entry("linear_attn.dt_bias", &[heads], false),
                entry("linear_attn.norm.weight", &[t.linear_value_head_dim], false),
            ]);
        }
        LayerType::Full => {
            let q_rows = t.num_attention_heads * t.head_dim;
            let kv_rows = t.num_key_value_heads * t.head_dim;
            tensors.extend([
                // Query and output gate per head, hence 2x.
                entry("self_attn.q_proj.weight", &[2 * q_rows, h], true),
                entry("self_attn.k_proj.weight", &[kv_rows, h], true),
                entry("self_attn.v_proj.weight", &[kv_rows, h], true),
                entry("self_attn.o_proj.weight", &[h, q_rows], true),
                entry("self_attn.q_norm.weight", &[t.head_dim], false),
                entry("self_attn.k_norm.weight", &[t.head_dim], false),
            ]);
        }
    }
    tensors.extend([
        entry("mlp.gate_proj.weight", &[t.intermediate_size, h], true),
        entry("mlp.up_proj.weight", &[t.intermediate_size, h], true),
        entry("mlp.down_proj.weight", &[h, t.intermediate_size], true),
    ]);
    tensors
}

/// §4: every language tensor (all BF16).
pub fn language(cfg: &Config) -> Table {
    let t = &cfg.text;
    let mut table = Table::new();
    table.insert(
        format!("{LANGUAGE_PREFIX}embed_tokens.weight"),
        vec![t.vocab_size, t.hidden_size],
    );
    table.insert(format!("{LANGUAGE_PREFIX}norm.weight"), vec![t.hidden_size]);
    for (i, &layer_type) in t.layer_types.iter().enumerate() {
        for tensor in layer_tensors(cfg, layer_type) {
            table.insert(
                format!("{LANGUAGE_PREFIX}layers.{i}.{}", tensor.suffix),
                tensor.shape,
            );
        }
    }
    table
}

/// One LoRA target: the language weight `[out, in]` and its adapter pair's names.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraTarget {
    /// `layers.{i}.{module}`, e.g. `layers.0.mlp.down_proj`.
    pub module: String,
    pub weight: String,
    pub lora_a: String,
    pub lora_b: String,
    pub out_features: usize,
    pub in_features: usize,
}

/// §5: every LoRA target, in layer order.
pub fn lora_targets(cfg: &Config) -> Vec<LoraTarget> {
    let mut targets = Vec::new();
    for (i, &layer_type) in cfg.text.layer_types.iter().enumerate() {
        for tensor in layer_tensors(cfg, layer_type)
            .into_iter()
            .filter(|t| t.lora_target)
        {
            let module = format!("layers.{i}.{}", tensor.suffix.trim_end_matches(".weight"));
            let stem = format!("{ADAPTER_PREFIX}{LANGUAGE_PREFIX}{module}");
            targets.push(LoraTarget {
                weight: format!("{LANGUAGE_PREFIX}{module}.weight"),
                lora_a: format!("{stem}.lora_A.weight"),
                lora_b: format!("{stem}.lora_B.weight"),
                module,
                out_features: tensor.shape[0],
                in_features: tensor.shape[1],
            });
        }
    }
    targets
}

/// §5: the adapter file's tensors for `rank`: A `[rank, in]`, B `[out, rank]` per target.
pub fn adapter(cfg: &Config, rank: usize) -> Table {
    lora_targets(cfg)
        .into_iter()
        .flat_map(|t| {
            [
                (t.lora_a, vec![rank, t.in_features]),
                (t.lora_b, vec![t.out_features, rank]),
            ]
        })
        .collect()
}

/// §6: the complete vision tower (all BF16).
pub fn vision(cfg: &Config) -> Table {
    let v = &cfg.vision;
    let (h, i, m) = (v.hidden_size, v.intermediate_size, cfg.merged_dim());
    let mut table = Table::new();
    let mut put = |name: String, shape: &[usize]| {
        table.insert(format!("{VISION_PREFIX}{name}"), shape.to_vec())
    };
    put(
        "patch_embed.proj.weight".into(),
        &[
            h,
            v.in_channels,
            v.temporal_patch_size,
            v.patch_size,
            v.patch_size,
        ],
    );
    put("patch_embed.proj.bias".into(), &[h]);
    put("pos_embed.weight".into(), &[v.num_position_embeddings, h]);
    for (suffix, shape) in block_tensors(h, i) {
        for b in 0..v.depth {
            put(format!("blocks.{b}.{suffix}"), &shape);
        }
    }
    put("merger.norm.weight".into(), &[h]);
    put("merger.norm.bias".into(), &[h]);
    put("merger.linear_fc1.weight".into(), &[m, m]);
    put("merger.linear_fc1.bias".into(), &[m]);
    put("merger.linear_fc2.weight".into(), &[v.out_hidden_size, m]);
    put("merger.linear_fc2.bias".into(), &[v.out_hidden_size]);
    table
}

/// The 12 tensors of one vision block (hidden `h`, MLP width `i`).
pub fn block_tensors(h: usize, i: usize) -> [(&'static str, Vec<usize>); 12] {
    [
        ("norm1.weight", vec![h]),
        ("norm1.bias", vec![h]),
        ("norm2.weight", vec![h]),
        ("norm2.bias", vec![h]),
        ("attn.qkv.weight", vec![3 * h, h]),
        ("attn.qkv.bias", vec![3 * h]),
        ("attn.proj.weight", vec![h, h]),
        ("attn.proj.bias", vec![h]),
        ("mlp.linear_fc1.weight", vec![i, h]),
        ("mlp.linear_fc1.bias", vec![i]),
        ("mlp.linear_fc2.weight", vec![h, i]),
        ("mlp.linear_fc2.bias", vec![h]),
    ]
}

/// §7: the head (both F32 `[projection_dim, text.hidden_size]`, names without prefix).
pub fn head(cfg: &Config, projection_dim: usize) -> Table {
    let shape = vec![projection_dim, cfg.text.hidden_size];
    [
        ("candidate.weight".to_string(), shape.clone()),
        ("decision.weight".to_string(), shape),
    ]
    .into()
}

/// Compares tensors of `file` with a table: unexpected names, shapes, and the one dtype
/// every tensor of the table has. Missing names are `report_missing`'s job.
pub fn compare<'a>(
    file: &str,
    actual: impl Iterator<Item = (&'a String, &'a TensorInfo)>,
    expected: &Table,
    dtype: Dtype,
    problems: &mut Problems,
) {
    for (name, info) in actual {
        let Some(shape) = expected.get(name) else {
            problems.push(format!("{file}: unexpected tensor {name}"));
            continue;
        };
        if &info.shape != shape {
            problems.push(format!(
                "{file}: tensor {name}: shape {:?}, expected {shape:?}",
                info.shape
            ));
        }
        if info.dtype != dtype {
            problems.push(format!(
                "{file}: tensor {name}: dtype {}, expected {dtype}",
                info.dtype
            ));
        }
    }
}

/// Reports every name of `expected` that `present` lacks.
pub fn report_missing(
    place: &str,
    expected: &Table,
    present: impl Fn(&str) -> bool,
    problems: &mut Problems,
) {
    for (name, shape) in expected {
        if !present(name) {
            problems.push(format!("{place}: missing tensor {name} (shape {shape:?})"));
        }
    }
}

/// One file against its whole table.
pub fn check_file(
    file: &str,
    header: &Header,
    expected: &Table,
    dtype: Dtype,
    problems: &mut Problems,
) {
    compare(file, header.tensors.iter(), expected, dtype, problems);
    report_missing(
        file,
        expected,
        |name| header.tensors.contains_key(name),
        problems,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{self, tests::tiny};

    #[test]
    fn counts_follow_the_doc_formulas() {
        let cfg = config::parse(&tiny()).unwrap();
        let (lin, full) = (3, 1);
        assert_eq!(language(&cfg).len(), 2 + 14 * lin + 11 * full);
        assert_eq!(lora_targets(&cfg).len(), 8 * lin + 7 * full);
        assert_eq!(adapter(&cfg, 32).len(), 2 * (8 * lin + 7 * full));
        assert_eq!(vision(&cfg).len(), 9 + 12 * cfg.vision.depth);
        assert_eq!(head(&cfg, 256).len(), 2);
    }

    #[test]
    fn shapes_follow_the_formulas() {
        let cfg = config::parse(&tiny()).unwrap();
        let lang = language(&cfg);
        assert_eq!(
            lang["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
            [96, 64]
        );
        assert_eq!(
            lang["model.language_model.layers.0.linear_attn.conv1d.weight"],
            [96, 1, 4]
        );
        assert_eq!(
            lang["model.language_model.layers.3.self_attn.q_proj.weight"],
            [256, 64]
        );
        assert_eq!(
            lang["model.language_model.layers.3.self_attn.o_proj.weight"],
            [64, 128]
        );
        assert!(!lang.contains_key("model.language_model.layers.3.linear_attn.A_log"));
        let vis = vision(&cfg);
        assert_eq!(
            vis["model.visual.patch_embed.proj.weight"],
            [32, 3, 2, 16, 16]
        );
        assert_eq!(vis["model.visual.merger.linear_fc2.weight"], [64, 128]);
    }

    #[test]
    fn lora_pairs_are_named_after_their_weight() {
        let cfg = config::parse(&tiny()).unwrap();
        let down = lora_targets(&cfg)
            .into_iter()
            .find(|t| t.module == "layers.0.mlp.down_proj")
            .unwrap();
        assert_eq!(
            down.weight,
            "model.language_model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(
            down.lora_a,
            "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_A.weight"
        );
        assert_eq!(
            down.lora_b,
            "base_model.model.model.language_model.layers.0.mlp.down_proj.lora_B.weight"
        );
        assert_eq!((down.out_features, down.in_features), (64, 128));
        let adapter = adapter(&cfg, 8);
        assert_eq!(adapter[&down.lora_a], [8, 128]);
        assert_eq!(adapter[&down.lora_b], [64, 8]);
    }
}
