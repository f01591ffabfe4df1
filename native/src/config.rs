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
    pub num_heads: usize,
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
    // §3: a field whose value is null counts as absent.
    let value = without_nulls(value);
    let root = Obj::root(&value, "config").map_err(|e| vec![e])?;
    let text = root
        .obj("text_config", "text_config")
        .map_err(|e| vec![e])?;
    let vision = root
        .obj("vision_config", "vision_config")
        .map_err(|e| vec![e])?;
    let mut errors = Errors::default();

    // Rule 1: the root.
    errors.take(root.expect_str("model_type", "qwen3_5"));
    for key in [
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
    ] {
        errors.take(integer(root, key));
    }
    optional_bool(root, "tie_word_embeddings", None, &mut errors);

    let config = Config {
        text: parse_text(text, &mut errors),
        vision: parse_vision(vision, &mut errors),
    };
    check_text_rules(text, &config.text, &mut errors);
    check_rope(text, config.text.head_dim, &mut errors);
    check_vision_rules(vision, &config.vision, &mut errors);
    // Rule 9.
    errors.require(
        config.vision.out_hidden_size == config.text.hidden_size,
        || {
            format!(
                "vision_config.out_hidden_size: expected text_config.hidden_size = {}, found {}",
                config.text.hidden_size, config.vision.out_hidden_size
            )
        },
    );
    if errors.0.is_empty() {
        Ok(config)
    } else {
        Err(errors.0)
    }
}

/// A copy with every null-valued object field removed, at any depth.
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

/// An integer of any sign (written without fraction or exponent).
fn integer(obj: Obj, key: &str) -> Result<i64, String> {
    let value = obj.get(key)?;
    value.as_i64().ok_or_else(|| {
        format!(
            "{}: expected an integer, found {}",
            obj.field_path(key),
            show(value)
        )
    })
}

/// When present, a boolean, and `want` if given.
fn optional_bool(obj: Obj, key: &str, want: Option<bool>, errors: &mut Errors) {
    if let Some(value) = obj.opt(key) {
        let ok = value
            .as_bool()
            .is_some_and(|b| want.is_none() || want == Some(b));
        errors.require(ok, || {
            let expected = want.map_or("a boolean".to_string(), |w| w.to_string());
            format!(
                "{}: expected {expected} or absent, found {}",
                obj.field_path(key),
                show(value)
            )
        });
    }
}

/// Rule 2 and rule 3: the integers the shape formulas use, and the layer types.
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
    if t.num_hidden_layers > 0 {
        t.layer_types = errors.take(parse_layer_types(text, t.num_hidden_layers));
    }
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

/// Rule 8's integers (`in_channels` defaults to 3).
fn parse_vision(vision: Obj, errors: &mut Errors) -> Vision {
    Vision {
        depth: errors.take(vision.positive("depth")),
        hidden_size: errors.take(vision.positive("hidden_size")),
        intermediate_size: errors.take(vision.positive("intermediate_size")),
        num_heads: errors.take(vision.positive("num_heads")),
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

/// Rules 2 (bounds), 4, 5 and 6 on `text_config`.
fn check_text_rules(text: Obj, t: &Text, errors: &mut Errors) {
    match text.positive("max_position_embeddings") {
        Err(e) => errors.0.push(e),
        Ok(n) => errors.require(n <= 1 << 24, || {
            format!(
                "text_config.max_position_embeddings: expected at most 2^24 = 16777216, found {n}"
            )
        }),
    }
    errors.require(
        t.linear_conv_kernel_dim == 4 || t.linear_conv_kernel_dim == 0,
        || {
            format!(
                "text_config.linear_conv_kernel_dim: expected 4, found {}",
                t.linear_conv_kernel_dim
            )
        },
    );
    errors.take(text.expect_str("hidden_act", "silu"));
    optional_bool(text, "attn_output_gate", Some(true), errors);
    optional_bool(text, "attention_bias", Some(false), errors);
    optional_bool(text, "tie_word_embeddings", None, errors);
    match text.get("rms_norm_eps") {
        Err(e) => errors.0.push(e),
        Ok(eps) => errors.require(eps.is_f64() && eps.as_f64().is_some_and(|x| x > 0.0), || {
            format!(
                "text_config.rms_norm_eps: expected a number > 0 written with a fraction or exponent, found {}",
                show(eps)
            )
        }),
    }
    let multiple = |a: usize, b: usize| a == 0 || b == 0 || a % b == 0;
    errors.require(
        multiple(t.num_attention_heads, t.num_key_value_heads),
        || {
            format!(
                "text_config.num_attention_heads: {} is not a multiple of num_key_value_heads {}",
                t.num_attention_heads, t.num_key_value_heads
            )
        },
    );
    errors.require(
        multiple(t.linear_num_value_heads, t.linear_num_key_heads),
        || {
            format!(
            "text_config.linear_num_value_heads: {} is not a multiple of linear_num_key_heads {}",
            t.linear_num_value_heads, t.linear_num_key_heads
        )
        },
    );
    errors.require(t.hidden_size % 8 == 0, || {
        format!(
            "text_config.hidden_size: {} is not a multiple of 8",
            t.hidden_size
        )
    });
}

const ROPE_KEYS: [&str; 5] = [
    "rope_type",
    "rope_theta",
    "partial_rotary_factor",
    "mrope_section",
    "mrope_interleaved",
];

/// Rule 7: default rope, interleaved M-RoPE whose three sections fill half the rotary dims.
fn check_rope(text: Obj, head_dim: usize, errors: &mut Errors) {
    let path = "text_config.rope_parameters";
    let empty = serde_json::Map::new();
    let (rope, theta) = match text.opt("rope_parameters") {
        None => (Obj { path, map: &empty }, text.number("rope_theta")),
        Some(v) => match v.as_object() {
            Some(map) => {
                let rope = Obj { path, map };
                if let Some(key) = map.keys().find(|k| !ROPE_KEYS.contains(&k.as_str())) {
                    errors.0.push(format!(
                        "{path}: unexpected key {key:?} (allowed: {})",
                        ROPE_KEYS.join(", ")
                    ));
                }
                (rope, rope.number("rope_theta"))
            }
            None => {
                errors
                    .0
                    .push(format!("{path}: expected an object, found {}", show(v)));
                return;
            }
        },
    };
    if rope.opt("rope_type").is_some() {
        errors.take(rope.expect_str("rope_type", "default"));
    }
    if let Some(theta) = errors.take(theta.map(Some)) {
        errors.require(theta.is_finite() && theta > 0.0, || {
            format!("rope theta: expected a finite number > 0, found {theta}")
        });
    }
    let factor = match (
        rope.opt("partial_rotary_factor"),
        text.opt("partial_rotary_factor"),
    ) {
        (None, None) => Some(0.25),
        (Some(_), None) => errors.take(rope.number("partial_rotary_factor").map(Some)),
        (None, Some(_)) => errors.take(text.number("partial_rotary_factor").map(Some)),
        (Some(_), Some(_)) => {
            let (a, b) = (
                errors.take(rope.number("partial_rotary_factor")),
                errors.take(text.number("partial_rotary_factor")),
            );
            errors.require(a == b, || format!("{path}.partial_rotary_factor: {a} differs from text_config.partial_rotary_factor {b}"));
            Some(a)
        }
    };
    let rotary = factor.map(|f| head_dim as f64 * f);
    let rotary = match rotary {
        Some(r) if r.fract() == 0.0 && r > 0.0 && r <= head_dim as f64 && (r as u64) % 2 == 0 => {
            Some(r as u64)
        }
        Some(r) => {
            errors.0.push(format!(
                "{path}.partial_rotary_factor: head_dim x factor = {r}, expected an even whole number in (0, head_dim {head_dim}]"
            ));
            None
        }
        None => None,
    };
    let section = match rope.opt("mrope_section") {
        None => Some(vec![11, 11, 10]),
        Some(_) => match rope.uint_list("mrope_section") {
            Ok(list) if list.len() == 3 => Some(list),
            Ok(list) => {
                errors.0.push(format!(
                    "{path}.mrope_section: {} entries, expected 3",
                    list.len()
                ));
                None
            }
            Err(e) => {
                errors.0.push(e);
                None
            }
        },
    };
    if let (Some(rotary), Some(section)) = (rotary, section) {
        let total: u64 = section.iter().sum();
        errors.require(total == rotary / 2, || {
            format!(
                "{path}.mrope_section: {section:?} sums to {total}, expected rotary dims / 2 = {}",
                rotary / 2
            )
        });
    }
    optional_bool(rope, "mrope_interleaved", Some(true), errors);
}

/// Rule 8 beyond the integers.
fn check_vision_rules(vision: Obj, v: &Vision, errors: &mut Errors) {
    if vision.opt("hidden_act").is_some() {
        errors.take(vision.expect_str("hidden_act", "gelu_pytorch_tanh"));
    }
    if let (Some(per_head), true) = (v.hidden_size.checked_div(v.num_heads), v.hidden_size > 0) {
        errors.require(
            v.hidden_size % v.num_heads == 0 && per_head % 4 == 0,
            || {
                format!(
                "vision_config.hidden_size: {} over num_heads {} must give a whole multiple of 4",
                v.hidden_size, v.num_heads
            )
            },
        );
    }
    let side = (v.num_position_embeddings as f64).sqrt().round() as usize;
    errors.require(side * side == v.num_position_embeddings, || {
        format!(
            "vision_config.num_position_embeddings: {} is not a perfect square",
            v.num_position_embeddings
        )
    });
    if let Some(indexes) = vision.opt("deepstack_visual_indexes") {
        errors.require(indexes.as_array().is_some_and(Vec::is_empty), || {
            format!(
                "vision_config.deepstack_visual_indexes: expected [] or absent, found {}",
                show(indexes)
            )
        });
    }
    // Nulls are gone already (null counts as absent).
    match vision.opt("rope_parameters").map(|r| (r, r.as_object())) {
        None => {}
        Some((rope, None)) => errors.0.push(format!(
            "vision_config.rope_parameters: expected an object, found {}",
            show(rope)
        )),
        Some((_, Some(rope))) => {
            if let Some(theta) = rope.get("rope_theta") {
                errors.require(theta.as_f64() == Some(10000.0), || {
                    format!(
                        "vision_config.rope_parameters.rope_theta: expected 10000, found {}",
                        show(theta)
                    )
                });
            }
        }
    }
}

#[cfg(test)]
pub mod tests {
    use super::*;

    /// An edit of a valid document and a fragment of the error it must cause.
    type Case = (fn(&mut Value), &'static str);
    use serde_json::json;

    /// A config in the shape of the tiny fixture (3 linear + 1 full layer).
    pub fn tiny() -> Value {
        json!({
            "model_type": "qwen3_5",
            "image_token_id": 12, "video_token_id": 13, "vision_start_token_id": 9, "vision_end_token_id": 10,
            "tie_word_embeddings": true,
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
                "depth": 6, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
                "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
                "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [],
                "hidden_act": "gelu_pytorch_tanh", "unknown_field": {"ignored": true}
            }
        })
    }

    #[test]
    fn parses_tiny_and_derives_dims() {
        let cfg = parse(&tiny()).unwrap();
        assert_eq!(
            cfg.text
                .layer_types
                .iter()
                .filter(|t| **t == LayerType::Linear)
                .count(),
            3
        );
        assert_eq!(
            (cfg.key_dim(), cfg.value_dim(), cfg.conv_dim()),
            (32, 32, 96)
        );
        assert_eq!(cfg.merged_dim(), 128);
    }

    #[test]
    fn in_channels_defaults_to_3() {
        let mut v = tiny();
        v["vision_config"]
            .as_object_mut()
            .unwrap()
            .remove("in_channels");
        assert_eq!(parse(&v).unwrap().vision.in_channels, 3);
    }

    fn errors_for(edit: impl FnOnce(&mut Value)) -> Vec<String> {
        let mut v = tiny();
        edit(&mut v);
        parse(&v).unwrap_err()
    }

    #[test]
    fn refuses_each_broken_rule_with_its_field() {
        let cases: Vec<Case> = vec![
            (|v| v["model_type"] = json!("qwen3"), "model_type"),
            (
                |v| v["video_token_id"] = json!(13.0),
                "video_token_id: expected an integer",
            ),
            (
                |v| {
                    v.as_object_mut().unwrap().remove("vision_end_token_id");
                },
                "vision_end_token_id: missing",
            ),
            (
                |v| v["tie_word_embeddings"] = json!("yes"),
                "tie_word_embeddings",
            ),
            (
                |v| v["text_config"]["layer_types"][1] = json!("mamba"),
                "layer_types[1]",
            ),
            (
                |v| v["text_config"]["num_hidden_layers"] = json!(5),
                "layer_types: 4 entries",
            ),
            (
                |v| v["text_config"]["hidden_act"] = json!("gelu"),
                "hidden_act",
            ),
            (
                |v| v["text_config"]["attention_bias"] = json!(true),
                "attention_bias",
            ),
            (
                |v| v["text_config"]["attention_bias"] = json!(0),
                "attention_bias",
            ),
            (
                |v| v["text_config"]["attn_output_gate"] = json!(false),
                "attn_output_gate",
            ),
            (
                |v| v["text_config"]["linear_conv_kernel_dim"] = json!(3),
                "linear_conv_kernel_dim",
            ),
            (
                |v| v["text_config"]["rope_parameters"]["mrope_section"] = json!([2, 2, 1]),
                "mrope_section",
            ),
            (
                |v| v["text_config"]["rope_parameters"]["mrope_section"] = json!([2, 2]),
                "mrope_section: 2 entries",
            ),
            (
                |v| v["text_config"]["rope_parameters"]["mrope_interleaved"] = json!(false),
                "mrope_interleaved",
            ),
            (
                |v| v["text_config"]["rope_parameters"]["rope_type"] = json!("yarn"),
                "rope_type",
            ),
            (
                |v| v["text_config"]["rope_parameters"]["scaling"] = json!(1),
                "unexpected key \"scaling\"",
            ),
            (
                |v| v["text_config"]["rope_parameters"]["partial_rotary_factor"] = json!(0.3),
                "partial_rotary_factor",
            ),
            (
                |v| v["text_config"]["partial_rotary_factor"] = json!(0.5),
                "differs from text_config.partial_rotary_factor",
            ),
            (
                |v| {
                    v["text_config"]["rope_parameters"]
                        .as_object_mut()
                        .unwrap()
                        .remove("rope_theta");
                },
                "rope_parameters.rope_theta: missing",
            ),
            (
                |v| v["text_config"]["max_position_embeddings"] = json!(1u64 << 25),
                "max_position_embeddings",
            ),
            (
                |v| v["text_config"]["rms_norm_eps"] = json!(1),
                "rms_norm_eps",
            ),
            (
                |v| v["text_config"]["rms_norm_eps"] = json!(-1e-6),
                "rms_norm_eps",
            ),
            (
                |v| v["text_config"]["num_key_value_heads"] = json!(3),
                "num_attention_heads",
            ),
            (
                |v| v["text_config"]["hidden_size"] = json!(60),
                "hidden_size",
            ),
            (|v| v["text_config"]["head_dim"] = json!(32.0), "head_dim"),
            (
                |v| v["vision_config"]["out_hidden_size"] = json!(32),
                "out_hidden_size",
            ),
            (
                |v| v["vision_config"]["deepstack_visual_indexes"] = json!([1]),
                "deepstack",
            ),
            (
                |v| v["vision_config"]["num_heads"] = json!(3),
                "num_heads 3",
            ),
            (
                |v| v["vision_config"]["num_position_embeddings"] = json!(60),
                "perfect square",
            ),
            (
                |v| v["vision_config"]["hidden_act"] = json!("gelu"),
                "vision_config.hidden_act",
            ),
            (
                |v| v["vision_config"]["rope_parameters"] = json!({"rope_theta": 500}),
                "vision_config.rope_parameters.rope_theta",
            ),
            (
                |v| v["vision_config"]["rope_parameters"] = json!([10000]),
                "vision_config.rope_parameters: expected an object",
            ),
            (|v| v["image_token_id"] = json!("12"), "image_token_id"),
        ];
        for (edit, field) in cases {
            let errors = errors_for(edit);
            assert!(
                errors.iter().any(|e| e.contains(field)),
                "{field}: {errors:?}"
            );
        }
    }

    #[test]
    fn accepts_vision_theta_as_integer_or_float() {
        for theta in [json!(10000), json!(10000.0)] {
            let mut v = tiny();
            v["vision_config"]["rope_parameters"] = json!({ "rope_theta": theta });
            assert!(parse(&v).is_ok());
        }
    }

    #[test]
    fn null_counts_as_absent() {
        let mut v = tiny();
        v["vision_config"]["in_channels"] = Value::Null;
        v["text_config"]["attention_bias"] = Value::Null;
        assert_eq!(parse(&v).unwrap().vision.in_channels, 3);
        v["text_config"]["hidden_act"] = Value::Null;
        assert!(parse(&v).unwrap_err()[0].contains("hidden_act: missing"));
    }

    #[test]
    fn rope_defaults_apply_when_absent() {
        // No rope_parameters: theta from text_config, section [11, 11, 10] needs 64 rotary dims.
        let without_rope = |v: &mut Value| {
            let text = v["text_config"].as_object_mut().unwrap();
            text.remove("rope_parameters");
            text.insert("rope_theta".into(), json!(1e7));
        };
        let errors = errors_for(without_rope);
        assert_eq!(errors.len(), 1);
        assert!(
            errors[0].contains("sums to 32, expected rotary dims / 2 = 4"),
            "{errors:?}"
        );
        let mut v = tiny();
        without_rope(&mut v);
        v["text_config"]["head_dim"] = json!(256);
        assert!(parse(&v).is_ok());
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("rope_theta");
        assert!(parse(&v).unwrap_err()[0].contains("text_config.rope_theta: missing"));
    }
}
