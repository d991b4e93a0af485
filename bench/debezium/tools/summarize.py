import json,glob,os
for f in sorted(glob.glob('results/2026-12-04/*.json')):
    r=json.load(open(f)); n=r['messages']; cpu=r['streamer_cpu_s']
    print(f"{os.path.basename(f)[:-5]:20} msgs={n:7} rate={r['throughput_msgs_per_s']:8.0f} p50={r['latency_p50_ms']:8.1f} p95={r['latency_p95_ms']:8.1f} p99={r['latency_p99_ms']:8.1f} max={r['latency_max_ms']:8.1f} cpu={cpu} us/msg={cpu*1e6/n if cpu else 0:6.0f} rss={r['streamer_peak_rss_mb']:.0f} lost={r['lost']} dup={r['duplicated']} ooo={r['out_of_order']} dur={r['duration_s']:.1f} drain={r.get('drain_s')}")
