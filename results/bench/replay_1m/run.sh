#!/usr/bin/env bash
# The million-row replay, with RSS sampled every 5 s (rss.tsv: seconds, KB).
cd /tmp/r1m
rm -rf /tmp/r1m/out
/usr/bin/time -v /work/main/.venv/bin/python -m harness executor=roofline roofline.model=Llama-3.1-8B roofline.hardware=h100-sxm cache.kv_budget=auto scheduler.max_num_seqs=256 workload=trace workload.path=/tmp/sg1m.jsonl workload.hash_block_tokens=64 records.output_ids=false logger=none progress=false hydra.run.dir=/tmp/r1m/out > /tmp/r1m/log 2> /tmp/r1m/time.txt &
pid=$!
t0=$(date +%s)
while kill -0 $pid 2>/dev/null; do
  c=$(pgrep -P $pid | head -1)
  [ -n "$c" ] && echo "$(( $(date +%s) - t0 ))	$(awk '/VmRSS/{print $2}' /proc/$c/status 2>/dev/null)" >> /tmp/r1m/rss.tsv
  sleep 5
done
echo done >> /tmp/r1m/rss.tsv
