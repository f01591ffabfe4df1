//! `config.json`: the values the shape formulas use and the Qwen3.5 settings a reader
//! must refuse to go beyond (export-format §3).

use serde_json::Value;

use crate::json::{show, Obj};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerType {
    /// `linear_attention`: a Gated DeltaNet layer.
    Linear,
    /// `full_attention`: a gated attention layer.
    Full,
}

#[derive(Debug, Default)]
pub struct Text {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub layer_types: Vec<LayerType>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_num_value_heads: usize,
    pub linear_value_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
}

#[derive(Debug, Default)]
pub struct Vision {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
}

#[derive(Debug, Default)]
pub struct Config {
    pub text: Text,
    pub vision: Vision,
}

impl Config {
    pub fn key_dim(&self) -> usize {
        self.text.linear_num_key_heads * self.text.linear_key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.text.linear_num_value_heads * self.text.linear_value_head_dim
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    pub fn merged_dim(&self) -> usize {
        let v = &self.vision;
        v.hidden_size * v.spatial_merge_size * v.spatial_merge_size
    }
}

/// Collects every broken rule instead of stopping at the first.
#[derive(Default)]
struct Errors(Vec<String>);

impl Errors {
    fn take<T: Default>(&mut self, result: Result<T, String>) -> T {
        result.unwrap_or_else(|e| {
            self.0.push(e);
            T::default()
        })
    }
    fn require(&mut self, ok: bool, message: impl FnOnce() -> String) {
        if !ok {
            self.0.push(message());
        }
    }
}

/// Parses `config.json` and checks every rule of §3; errors name the field.
pub fn parse(value: &Value) -> Result<Config, Vec<String>> {
    let root = Obj::root(value, "config").map_err(|e| vec![e])?;
    let text = root.obj("text_config", "text_config").map_err(|e| vec![e])?;
    let vision = root.obj("vision_config", "vision_config").map_err(|e| vec![e])?;
    let mut errors = Errors::default();

    errors.take(root.expect_str("model_type", "qwen3_5"));
    let image_token = errors.take(root.get("image_token_id").map(Some));
    errors.require(image_token.map_or(true, |v| v.is_i64() || v.is_u64()), || {
        format!("image_token_id: expected an integer, found {}", show(image_token.unwrap()))
    });

    let config = Config { text: parse_text(text, &mut errors), vision: parse_vision(vision, &mut errors) };
    check_text_rules(text, &config.text, &mut errors);
    errors.require(config.vision.out_hidden_size == config.text.hidden_size, || {
        format!(
            "vision_config.out_hidden_size: expected text_config.hidden_size = {}, found {}",
            config.text.hidden_size, config.vision.out_hidden_size
        )
    });
    if let Some(indexes) = vision.opt("deepstack_visual_indexes") {
        errors.require(indexes.as_array().map_or(false, Vec::is_empty), || {
            format!("vision_config.deepstack_visual_indexes: expected [] or absent, found {}", show(indexes))
        });
    }
    if errors.0.is_empty() {
        Ok(config)
    } else {
        Err(errors.0)
    }
}

fn parse_text(text: Obj, errors: &mut Errors) -> Text {
    let mut t = Text {
        vocab_size: errors.take(text.positive("vocab_size")),
        hidden_size: errors.take(text.positive("hidden_size")),
        intermediate_size: errors.take(text.positive("intermediate_size")),
        num_hidden_layers: errors.take(text.positive("num_hidden_layers")),
        layer_types: Vec::new(),
        num_attention_heads: errors.take(text.positive("num_attention_heads")),
        num_key_value_heads: errors.take(text.positive("num_key_value_heads")),
        head_dim: errors.take(text.positive("head_dim")),
        linear_num_key_heads: errors.take(text.positive("linear_num_key_heads")),
        linear_key_head_dim: errors.take(text.positive("linear_key_head_dim")),
        linear_num_value_heads: errors.take(text.positive("linear_num_value_heads")),
        linear_value_head_dim: errors.take(text.positive("linear_value_head_dim")),
        linear_conv_kernel_dim: errors.take(text.positive("linear_conv_kernel_dim")),
    };
    t.layer_types = errors.take(parse_layer_types(text, t.num_hidden_layers));
    t
}

fn parse_layer_types(text: Obj, layers: usize) -> Result<Vec<LayerType>, String> {
    let names = text.str_list("layer_types")?;
    if names.len() != layers {
        return Err(format!(
            "text_config.layer_types: {} entries, expected num_hidden_layers = {layers}",
            names.len()
        ));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, name)| match *name {
            "linear_attention" => Ok(LayerType::Linear),
            "full_attention" => Ok(LayerType::Full),
            other => Err(format!(
                "text_config.layer_types[{i}]: expected \"linear_attention\" or \"full_attention\", found {other:?}"
            )),
        })
        .collect()
}

fn parse_vision(vision: Obj, errors: &mut Errors) -> Vision {
    Vision {
        depth: errors.take(vision.positive("depth")),
        hidden_size: errors.take(vision.positive("hidden_size")),
        intermediate_size: errors.take(vision.positive("intermediate_size")),
        in_channels: match vision.opt("in_channels") {
            None => 3,
            Some(_) => errors.take(vision.positive("in_channels")),
        },
        patch_size: errors.take(vision.positive("patch_size")),
        temporal_patch_size: errors.take(vision.positive("temporal_patch_size")),
        spatial_merge_size: errors.take(vision.positive("spatial_merge_size")),
        out_hidden_size: errors.take(vision.positive("out_hidden_size")),
        num_position_embeddings: errors.take(vision.positive("num_position_embeddings")),
    }
}

/// Rules 3 to 7 of §3 on `text_config`.
fn check_text_rules(text: Obj, t: &Text, errors: &mut Errors) {
    errors.take(text.expect_str("hidden_act", "silu"));
    if let Some(gate) = text.opt("attn_output_gate") {
        errors.require(gate == &Value::Bool(true), || {
            format!("text_config.attn_output_gate: expected true or absent, found {}", show(gate))
        });
    }
    if let Some(bias) = text.opt("attention_bias") {
        errors.require(bias == &Value::Bool(false), || {
            format!("text_config.attention_bias: expected false or absent, found {}", show(bias))
        });
    }
    errors.require(t.linear_conv_kernel_dim == 4 || t.linear_conv_kernel_dim == 0, || {
        format!("text_config.linear_conv_kernel_dim: expected 4, found {}", t.linear_conv_kernel_dim)
    });
    check_rope(text, t.head_dim, errors);

    let max_pos = errors.take(text.uint("max_position_embeddings").map(Some));
    if let Some(n) = max_pos {
        errors.require(n > 0 && n <= 1 << 24, || {
            format!("text_config.max_position_embeddings: expected an integer in (0, 2^24], found {n}")
        });
    }
    match text.get("rms_norm_eps") {
        Err(e) => errors.0.push(e),
        Ok(eps) => errors.require(eps.is_f64() && eps.as_f64().map_or(false, |x| x > 0.0), || {
            format!(
                "text_config.rms_norm_eps: expected a number > 0 written with a fraction or exponent, found {}",
                show(eps)
            )
        }),
    }
    let multiple = |a: usize, b: usize| b > 0 && a % b == 0;
    if t.num_attention_heads > 0 && t.num_key_value_heads > 0 {
        errors.require(multiple(t.num_attention_heads, t.num_key_value_heads), || {
            format!(
                "text_config.num_attention_heads: {} is not a multiple of num_key_value_heads {}",
                t.num_attention_heads, t.num_key_value_heads
            )
        });
    }
    if t.linear_num_value_heads > 0 && t.linear_num_key_heads > 0 {
        errors.require(multiple(t.linear_num_value_heads, t.linear_num_key_heads), || {
            format!(
                "text_config.linear_num_value_heads: {} is not a multiple of linear_num_key_heads {}",
                t.linear_num_value_heads, t.linear_num_key_heads
            )
        });
    }
    errors.require(t.hidden_size % 8 == 0, || {
        format!("text_config.hidden_size: {} is not a multiple of 8", t.hidden_size)
    });
}

/// Rule 4 of §3: default rope, interleaved M-RoPE whose sections fill the rotary half.
fn check_rope(text: Obj, head_dim: usize, errors: &mut Errors) {
    let empty = serde_json::Map::new();
    let rope = match text.opt("rope_parameters") {
        None => Obj { path: "text_config.rope_parameters", map: &empty },
        Some(v) => match v.as_object() {
            Some(map) => Obj { path: "text_config.rope_parameters", map },
            None => {
                errors.0.push(format!("text_config.rope_parameters: expected an object, found {}", show(v)));
                return;
            }
        },
    };
    if rope.opt("rope_type").is_some() {
        errors.take(rope.expect_str("rope_type", "default"));
    }
    let theta = match rope.opt("rope_theta") {
        Some(_) => rope.number("rope_theta"),
        None => text.number("rope_theta").map_err(|_| {
            "text_config.rope_parameters.rope_theta: missing (and no text_config.rope_theta)".to_string()
        }),
    };
    if let Some(theta) = errors.take(theta.map(Some)) {
        errors.require(theta.is_finite() && theta > 0.0, || format!("rope theta: expected > 0, found {theta}"));
    }
    if let Some(interleaved) = rope.opt("mrope_interleaved") {
        errors.require(interleaved != &Value::Bool(false), || {
            "text_config.rope_parameters.mrope_interleaved: expected not false".to_string()
        });
    }
    let factor = match rope.opt("partial_rotary_factor") {
        None => 0.25,
        Some(_) => errors.take(rope.number("partial_rotary_factor")),
    };
    errors.require(factor > 0.0 && factor <= 1.0, || {
        format!("text_config.rope_parameters.partial_rotary_factor: expected a number in (0, 1], found {factor}")
    });
    let section = match rope.opt("mrope_section") {
        None => vec![11, 11, 10],
        Some(_) => errors.take(rope.uint_list("mrope_section")),
    };
    let rotary_half = ((head_dim as f64 * factor).floor() as u64) / 2;
    let total: u64 = section.iter().sum();
    errors.require(total == rotary_half, || {
        format!(
            "text_config.rope_parameters.mrope_section: sums to {total}, expected floor(floor(head_dim {head_dim} x partial_rotary_factor {factor}) / 2) = {rotary_half}"
        )
    });
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use serde_json::json;

    /// A config in the shape of the tiny fixture (3 linear + 1 full layer).
    pub fn tiny() -> Value {
        json!({
            "model_type": "qwen3_5",
            "image_token_id": 12,
            "text_config": {
                "vocab_size": 804, "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                "attn_output_gate": true, "attention_bias": false,
                "linear_num_key_heads": 2, "linear_num_value_heads": 2,
                "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                "hidden_act": "silu", "rms_norm_eps": 1e-06, "max_position_embeddings": 4096,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                    "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1], "mrope_interleaved": true}
            },
            "vision_config": {
                "depth": 6, "hidden_size": 32, "intermediate_size": 64, "in_channels": 3,
                "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": []
            }
        })
    }

    #[test]
    fn parses_tiny_and_derives_dims() {
        let cfg = parse(&tiny()).unwrap();
        assert_eq!(cfg.text.layer_types.iter().filter(|t| **t == LayerType::Linear).count(), 3);
        assert_eq!((cfg.key_dim(), cfg.value_dim(), cfg.conv_dim()), (32, 32, 96));
        assert_eq!(cfg.merged_dim(), 128);
    }

    #[test]
    fn in_channels_defaults_to_3() {
        let mut v = tiny();
        v["vision_config"].as_object_mut().unwrap().remove("in_channels");
        assert_eq!(parse(&v).unwrap().vision.in_channels, 3);
    }

    fn errors_for(edit: impl FnOnce(&mut Value)) -> Vec<String> {
        let mut v = tiny();
        edit(&mut v);
        parse(&v).unwrap_err()
    }

    #[test]
    fn refuses_each_broken_rule_with_its_field() {
        let cases: Vec<(fn(&mut Value), &str)> = vec![
            (|v| v["model_type"] = json!("qwen3"), "model_type"),
            (|v| v["text_config"]["layer_types"][1] = json!("mamba"), "layer_types[1]"),
            (|v| v["text_config"]["num_hidden_layers"] = json!(5), "layer_types: 4 entries"),
            (|v| v["text_config"]["hidden_act"] = json!("gelu"), "hidden_act"),
            (|v| v["text_config"]["attention_bias"] = json!(true), "attention_bias"),
            (|v| v["text_config"]["linear_conv_kernel_dim"] = json!(3), "linear_conv_kernel_dim"),
            (|v| v["text_config"]["rope_parameters"]["mrope_section"] = json!([2, 2, 1]), "mrope_section"),
            (|v| v["text_config"]["rope_parameters"]["mrope_interleaved"] = json!(false), "mrope_interleaved"),
            (|v| v["text_config"]["rope_parameters"]["rope_type"] = json!("yarn"), "rope_type"),
            (|v| v["text_config"]["max_position_embeddings"] = json!(1u64 << 25), "max_position_embeddings"),
            (|v| v["text_config"]["rms_norm_eps"] = json!(1), "rms_norm_eps"),
            (|v| v["text_config"]["num_key_value_heads"] = json!(3), "num_attention_heads"),
            (|v| v["text_config"]["hidden_size"] = json!(60), "hidden_size"),
            (|v| v["text_config"]["head_dim"] = json!(32.0), "head_dim"),
            (|v| v["vision_config"]["out_hidden_size"] = json!(32), "out_hidden_size"),
            (|v| v["vision_config"]["deepstack_visual_indexes"] = json!([1]), "deepstack"),
            (|v| v["image_token_id"] = json!("12"), "image_token_id"),
        ];
        for (edit, field) in cases {
            let errors = errors_for(edit);
            assert!(errors.iter().any(|e| e.contains(field)), "{field}: {errors:?}");
        }
    }

    #[test]
    fn rope_defaults_apply_when_absent() {
        // No rope_parameters: theta from text_config, section [11, 11, 10] needs head_dim 256.
        let errors = errors_for(|v| {
            let text = v["text_config"].as_object_mut().unwrap();
            text.remove("rope_parameters");
            text.insert("rope_theta".into(), json!(1e7));
        });
        assert_eq!(errors.len(), 1);
        assert!(errors[0].contains("sums to 32"), "{errors:?}");
        let mut v = tiny();
        let text = v["text_config"].as_object_mut().unwrap();
        text.remove("rope_parameters");
        text.insert("rope_theta".into(), json!(1e7));
        text.insert("head_dim".into(), json!(256));
        assert!(parse(&v).is_ok());
    }
}
