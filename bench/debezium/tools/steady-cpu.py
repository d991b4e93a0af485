import glob,os
# Steady window of a 60 s run at 1,000 msg/s: the streamer process's utime+stime between
# 25 s and 55 s after it was first seen (writing starts within ~1-3 s of process start).
for f in sorted(glob.glob('results/2026-12-04/pg60*.samples')):
    rows=[l.split() for l in open(f) if not l.startswith('pid') and len(l.split())==2]
    rows=[(float(a),int(b)) for a,b in rows]
    if not rows or rows[-1][0]-rows[0][0] < 56: print(os.path.basename(f),'no full sample series'); continue
    t0=rows[0][0]
    w=[r for r in rows if t0+25<=r[0]<=t0+55]
    dt=w[-1][0]-w[0][0]; dc=(w[-1][1]-w[0][1])/100
    print(f"{os.path.basename(f):24} window {dt:5.1f} s cpu {dc:5.2f} s = {dc/dt*100:5.1f} % of a core => {dc/dt*1000:4.0f} us/msg")
