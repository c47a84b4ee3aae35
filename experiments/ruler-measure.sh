# Sourced by experiments/ruler-quizzes.sh, ruler-keys.sh and ruler-lines.sh, which set F (the
# farsight command) and OUT (the results folder): prepares the corpus and checks that make ruler's
# models/ruler-drt-x2, where their runs start, is there. Every measurement reads 2 chunks as make
# ruler's models do, in bf16, and is skipped where its record exists.
mkdir -p "$OUT"
bash experiments/lm-data.sh
[ -f models/ruler-drt-x2/config.json ] || { echo "models/ruler-drt-x2 is missing: run make ruler first" >&2; exit 1; }
READING=(--retrieval-top-k 2)
GRID=(--tasks niah_multikey_2,niah_single_1 --lengths 1k,4k,16k --depths 0.1,0.5,0.9 --trials 8 --corpus data/lm-byte
    --dtype bf16)

measure() {  # MODEL NAME [LENGTH...]: farsight's grid (RULER's wording, never trained), and
    # lm-eval's two needle tasks at 4K and each LENGTH (one call a length), 50 items each, into
    # $OUT/NAME.json and $OUT/NAME-lm-eval-LENGTH.json
    local model=$1 name=$2 length
    shift 2
    [ -f "$OUT/$name.json" ] || $F eval ruler --model "$model" "${READING[@]}" "${GRID[@]}" --out "$OUT/$name.json"
    for length in 4096 "$@"; do
        [ -f "$OUT/$name-lm-eval-$length.json" ] || $F eval harness --model "$model" "${READING[@]}" \
            --tasks niah_single_1,niah_multikey_2 --metadata "{\"max_seq_lengths\": [$length]}" --limit 50 \
            --dtype bf16 --out "$OUT/$name-lm-eval-$length.json" --samples "$OUT/$name-lm-eval-$length-samples.jsonl"
    done
}

passkey_grid() {  # MODEL NAME: make ruler's passkey grid, 1K to 1M tokens, into $OUT/NAME-passkey.json
    [ -f "$OUT/$2-passkey.json" ] || $F eval passkey --model "$1" "${READING[@]}" \
        --lengths 1k,4k,16k,64k,256k,1m --depths 0.1,0.3,0.5,0.7,0.9 --trials 8 --long-trials 2 \
        --corpus data/lm-byte --dtype bf16 --out "$OUT/$2-passkey.json"
}
