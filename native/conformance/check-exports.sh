#!/usr/bin/env bash
# Runs valen-native-check on good exports (must pass, vectors included) and on damaged
# copies (each must be refused with the expected line).
#   conformance/check-exports.sh CHECKER DIR
# DIR holds exports separate/, merged/, single/ and their *.vectors.json (see README.md).
set -u
checker=$1 dir=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

expect() {  # expect CODE PATTERN ARGS...: exit code and one output line matching PATTERN
    local code=$1 pattern=$2; shift 2
    local out rc
    out=$("$checker" "$@" 2>&1); rc=$?
    if [ "$rc" != "$code" ] || ! grep -qE -- "$pattern" <<<"$out"; then
        echo "FAIL: $* -> exit $rc (expected $code, a line matching /$pattern/):"
        sed 's/^/    /' <<<"$out"
        failures=$((failures + 1))
    else
        echo "ok:   $(basename "${1}") exit $rc: $(grep -E -m1 -- "$pattern" <<<"$out")"
    fi
}

for mode in separate merged single; do
    expect 0 "conforms to valen-native/1" "$dir/$mode" --vectors "$dir/$mode.vectors.json"
done

damage() {  # damage CASE SOURCE PATTERN
    python3 "$here/damage.py" "$1" "$dir/$2" "$work/$1" && expect 1 "$3" "$work/$1"
}
damage flipped-byte separate '^vision\.safetensors: SHA-256 [0-9a-f]{64}, expected'
damage missing-lora-b separate '^adapter_model\.safetensors: LoRA pair of .* lacks lora_B'
damage wrong-dtype merged 'tensor model\.language_model\.norm\.weight: dtype F32, expected BF16'
damage renamed-tensor separate '^vision\.safetensors: unexpected tensor model\.visual\.blocks\.0\.norm_1\.weight'
damage unknown-format separate '^valen_export\.json: format: expected exactly "valen-native/1", found "valen-native/2"'
damage non-finite merged '^valen_head\.safetensors: tensor decision\.weight: element 0 is not finite'
damage extra-file single '^notes\.txt: not listed in valen_export\.json'
damage wrong-scale separate '^valen_export\.json: lora\.scale: expected lora\.alpha / lora\.rank'
damage wrong-trained-blocks merged '^valen_export\.json: vision\.trained_blocks: expected the last 2 of'
damage repeated-key separate '^valen_head\.safetensors: header is not valid JSON: repeated key'
damage fp32-source-mismatch single '^fp32_sources\.safetensors: tensor .*: element 0 does not round'
damage transposed-lora-a separate '^adapter_model\.safetensors: tensor .*mlp\.gate_proj\.lora_A\.weight: shape \[64, 32\], expected \[32, 64\]'
damage listed-extra-file merged '^valen_export\.json: files: notes\.txt is not a file of this export'
damage uppercase-hash separate '^valen_export\.json: files\.config\.json\.sha256: expected 64 lowercase hex digits'
damage wrong-shape separate '^valen_head\.safetensors: tensor candidate\.weight: shape \[64, 256\], expected \[256, 64\]'

# Vectors: another export's file, a tampered expected value, and separate-mode probes
# recomputed on the merged weights (the doc says the two differ beyond the bounds).
expect 1 'manifest_sha256 .* is not the SHA-256' "$dir/merged" --vectors "$dir/separate.vectors.json"
python3 - "$dir" "$work" <<'PY'
import hashlib, json, sys
d, w = sys.argv[1:]
v = json.load(open(f"{d}/separate.vectors.json"))
v["projections"][1]["expected"][0][3] += 4 * v["projections"][1]["bound"][0][3]
json.dump(v, open(f"{w}/tampered.vectors.json", "w"))
v = json.load(open(f"{d}/separate.vectors.json"))
v["head"]["bound"] = [b * 10 for b in v["head"]["bound"]]
json.dump(v, open(f"{w}/loose.vectors.json", "w"))
v = json.load(open(f"{d}/separate.vectors.json"))
m = json.load(open(f"{d}/merged/valen_export.json"))
v["manifest_sha256"] = hashlib.sha256(open(f"{d}/merged/valen_export.json", "rb").read()).hexdigest()
v["lora_mode"] = "merged"
for p in v["projections"]:
    p.update(mode="merged", lora_a=None, lora_b=None, scale=None, roundings=len(p["input"][0]))
json.dump(v, open(f"{w}/cross.vectors.json", "w"))
PY
expect 1 'projection layers\.3\.self_attn\.o_proj \(separate\): 1 of 128 values differ' "$dir/separate" --vectors "$work/tampered.vectors.json"
expect 1 'head logits: bound\[0\] = .* is larger than section 14' "$dir/separate" --vectors "$work/loose.vectors.json"
expect 1 'projection .*\(merged\): [0-9]+ of [0-9]+ values differ from expected beyond the bound' "$dir/merged" --vectors "$work/cross.vectors.json"
expect 2 'usage' "$dir/separate" --vectors
expect 2 'not a directory' "$work/does-not-exist"

if [ "$failures" -ne 0 ]; then
    echo "$failures check(s) failed"
    exit 1
fi
echo "all checks passed"
