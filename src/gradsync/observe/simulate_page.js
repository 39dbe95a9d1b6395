// gradsync simulate --html: the step simulator re-implemented for live sliders.
// It mirrors gradsync/engine/bucketing.py (plan_buckets) and gradsync/plan/simulate.py
// (simulate_step, synthetic_profile) line by line, in the same arithmetic order, so at
// the initial settings it reproduces the Python result embedded in the page (#gs-data);
// the page says whether the two agree, and the browser test checks it.
"use strict";

const DATA = JSON.parse(document.getElementById("gs-data").textContent);
const MIB = 1024 * 1024;

function mbToBytes(mb) { return Math.max(1, Math.floor(mb * MIB)); }

function planBuckets(params, cap, firstBytes) {
  const n = params.length, order = [];
  for (let i = n - 1; i >= 0; i--) order.push(i);
  const firstCap = Math.min(firstBytes, cap);
  const open = new Map(), openBytes = new Map(), seen = new Set(), closed = [];
  for (const i of order) {
    const p = params[i], nb = p.numel * p.itemsize;
    let members = open.get(p.dtype);
    if (members && members.length) {
      const c = seen.has(p.dtype) ? cap : firstCap;
      if (openBytes.get(p.dtype) + nb > c) { closed.push(members); seen.add(p.dtype); members = null; }
    }
    if (!members || !members.length) { members = []; open.set(p.dtype, members); openBytes.set(p.dtype, 0); }
    members.push(i);
    openBytes.set(p.dtype, openBytes.get(p.dtype) + nb);
  }
  for (const m of open.values()) if (m.length) closed.push(m);
  const pos = new Array(n);
  order.forEach((idx, k) => { pos[idx] = k; });
  closed.sort((a, b) => pos[a[a.length - 1]] - pos[b[b.length - 1]]);
  return closed.map((m) => ({ params: m, nbytes: m.reduce((s, i) => s + params[i].numel * params[i].itemsize, 0) }));
}

function syntheticProfile(s, layers, alpha, bandwidth) {
  const base = Math.floor(s.params_per_layer / s.tensors_per_layer), extra = s.params_per_layer % s.tensors_per_layer;
  const params = [];
  for (let l = 0; l < layers; l++) {
    for (let j = 0; j < s.tensors_per_layer; j++) {
      const numel = base + (j < extra ? 1 : 0);
      params.push({ name: "layers." + l + ".p" + j, numel: numel, itemsize: s.itemsize, dtype: "float32",
                    backward_s: s.backward_s_per_layer * numel / s.params_per_layer });
    }
  }
  const fwd = s.forward_s === null ? layers * s.backward_s_per_layer / 2 : s.forward_s;
  return { forward_s: fwd, params: params, optimizer_s: s.optimizer_s, alpha_s: alpha,
           beta_s_per_byte: 1.0 / bandwidth, world_size: s.world_size };
}

function allreduceCost(nbytes, n, alpha, beta) {
  if (n <= 1) return 0.0;
  return alpha + 2.0 * (n - 1) / n * nbytes * beta;
}

// plan/contention.py's contended_schedule: backward and all-reduce share the cores.
function contendedSchedule(work, startS, bucketParams, bucketCost, f, g) {
  const n = work.length, ready = new Array(n).fill(NaN), grads = [];
  const pending = bucketParams.map((ps) => ps.length), owner = new Map();
  bucketParams.forEach((ps, k) => { for (const i of ps) owner.set(i, k); });
  const spans = new Array(bucketParams.length);
  let t = startS, ci = 0, cStart = startS, crem = n ? work[n - 1] : 0.0;
  let cur = null, mrem = 0.0, mStart = 0.0, nb = 0;
  while (ci < n || cur !== null || nb < bucketParams.length) {
    if (cur === null && nb < bucketParams.length && pending[nb] === 0) {
      cur = nb; mrem = bucketCost[nb]; mStart = t; nb += 1; continue;
    }
    const computing = ci < n, comm = cur !== null;
    if (!computing && !comm) throw new Error("a bucket never became ready");
    const rc = comm ? (1.0 - f) : 1.0, rm = computing ? (1.0 - g) : 1.0;
    const dtC = computing ? crem / rc : Infinity, dtM = comm ? mrem / rm : Infinity;
    const dt = Math.min(dtC, dtM);
    t += dt;
    if (computing) crem -= dt * rc;
    if (comm) mrem -= dt * rm;
    if (computing && dtC <= dtM) {
      const i = n - 1 - ci;
      grads.push([cStart, t]); ready[i] = t;
      if (owner.has(i)) pending[owner.get(i)] -= 1;
      ci += 1; cStart = t; crem = ci < n ? work[n - 1 - ci] : 0.0;
    }
    if (comm && dtM <= dtC) { spans[cur] = [mStart, t]; cur = null; }
  }
  return { grads: grads, ready: ready, spans: spans };
}

function simulateStep(profile, bucketMb, firstMb, accum) {
  const params = profile.params;
  const buckets = planBuckets(params, mbToBytes(bucketMb), mbToBytes(firstMb));
  let bwdTotal = 0;
  for (const p of params) bwdTotal += p.backward_s;
  const micro = profile.forward_s + bwdTotal;
  let t = (accum - 1) * micro + profile.forward_s;
  const f = profile.overlap_compute_penalty || 0.0, g = profile.overlap_comm_penalty || 0.0;
  if ((f || g) && profile.world_size > 1) {
    const costs = buckets.map((b) => allreduceCost(b.nbytes, profile.world_size, profile.alpha_s, profile.beta_s_per_byte));
    const sch = contendedSchedule(params.map((p) => p.backward_s), t, buckets.map((b) => b.params), costs, f, g);
    const bwdEnd = sch.grads.length ? sch.grads[sch.grads.length - 1][1] : t;
    const lane = sch.spans.length ? sch.spans[sch.spans.length - 1][1] : t;
    let comm = 0.0;
    for (const [s0, e0] of sch.spans) comm += e0 - s0;
    const step = Math.max(bwdEnd, lane) + profile.optimizer_s;
    const compute = accum * micro + profile.optimizer_s;
    return { step_s: step, backward_s: accum * bwdTotal, comm_s: comm, exposed_s: step - compute,
             efficiency: step > 0 ? compute / step : 1.0, bwdStart: t, bwdEnd: bwdEnd,
             forward_s: profile.forward_s, optimizer_s: profile.optimizer_s, grads: sch.grads,
             buckets: sch.spans };
  }
  const bwdStart = t, ready = new Array(params.length), grads = [];
  for (let i = params.length - 1; i >= 0; i--) {
    const end = t + params[i].backward_s;
    grads.push([t, end]); ready[i] = end; t = end;
  }
  const bwdEnd = t;
  let lane = bwdStart, comm = 0.0;
  const events = [];
  for (const b of buckets) {
    let r = -Infinity;
    for (const i of b.params) r = Math.max(r, ready[i]);
    const start = Math.max(r, lane);
    const dur = allreduceCost(b.nbytes, profile.world_size, profile.alpha_s, profile.beta_s_per_byte);
    lane = start + dur; comm += dur;
    events.push([start, lane]);
  }
  const step = Math.max(bwdEnd, lane) + profile.optimizer_s;
  const compute = accum * micro + profile.optimizer_s;
  return { step_s: step, backward_s: accum * bwdTotal, comm_s: comm, exposed_s: step - compute,
           efficiency: step > 0 ? compute / step : 1.0, bwdStart: bwdStart, bwdEnd: bwdEnd,
           forward_s: profile.forward_s, optimizer_s: profile.optimizer_s, grads: grads, buckets: events };
}

// ---- state and sliders ------------------------------------------------------
const init = DATA.initial;
const state = { bucket_mb: init.bucket_mb, bandwidth: init.bandwidth, alpha_s: init.alpha_s, layers: init.layers };
const $ = (id) => document.getElementById(id);

function currentProfile() {
  if (DATA.synthetic) return syntheticProfile(DATA.synthetic, state.layers, state.alpha_s, state.bandwidth);
  const p = DATA.profile;
  return { forward_s: p.forward_s, params: p.params, optimizer_s: p.optimizer_s, alpha_s: state.alpha_s,
           beta_s_per_byte: 1.0 / state.bandwidth, world_size: p.world_size,
           overlap_compute_penalty: p.overlap_compute_penalty || 0.0,
           overlap_comm_penalty: p.overlap_comm_penalty || 0.0 };
}

function fmtTime(s) {
  if (s >= 1) return s.toFixed(3) + " s";
  if (s >= 1e-3) return (s * 1e3).toFixed(2) + " ms";
  return (s * 1e6).toFixed(1) + " us";
}
function fmtMb(mb) { return mb >= 100 ? mb.toFixed(0) : mb >= 10 ? mb.toFixed(1) : mb.toFixed(2); }
function setKpi(id, text, value) { const el = $(id); el.textContent = text; if (value !== undefined) el.dataset.value = String(value); }

const SVGNS = "http://www.w3.org/2000/svg";
function el(tag, attrs, parent) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}

function drawTimeline(r) {
  const svg = $("timeline"); svg.replaceChildren();
  const W = 900, H = 120, x0 = 70, span = Math.max(r.step_s, 1e-12), sx = (t) => x0 + (W - x0 - 10) * t / span;
  el("text", { x: 4, y: 38, class: "lane" }, svg).textContent = "compute";
  el("text", { x: 4, y: 88, class: "lane" }, svg).textContent = "comm";
  el("rect", { x: sx(0), y: 20, width: Math.max(0, sx(r.bwdStart) - sx(0)), height: 30, class: "fwd" }, svg);
  r.grads.forEach((g, k) => el("rect", { x: sx(g[0]), y: 20, width: Math.max(0.5, sx(g[1]) - sx(g[0])), height: 30, class: k % 2 ? "bwd" : "bwd2" }, svg));
  const optStart = r.step_s - r.optimizer_s;
  if (r.optimizer_s > 0) el("rect", { x: sx(optStart), y: 20, width: sx(r.step_s) - sx(optStart), height: 30, class: "opt" }, svg);
  r.buckets.forEach((b, k) => el("rect", { x: sx(b[0]), y: 70, width: Math.max(0.5, sx(b[1]) - sx(b[0])), height: 30, class: k % 2 ? "ar" : "ar2" }, svg));
  if (r.exposed_s > 0) el("rect", { x: sx(r.bwdEnd), y: 10, width: Math.max(0, sx(optStart) - sx(r.bwdEnd)), height: 100, class: "exposed" }, svg);
  el("text", { x: W - 10, y: H - 2, "text-anchor": "end", class: "axis" }, svg).textContent = fmtTime(r.step_s);
}

function drawSweep(sizes, steps, bestK) {
  const svg = $("sweep"); svg.replaceChildren();
  const W = 900, H = 240, x0 = 70, y0 = 20, y1 = H - 30;
  const lx = (mb) => x0 + (W - x0 - 10) * Math.log(mb / sizes[0]) / Math.log(sizes[sizes.length - 1] / sizes[0]);
  const lo = Math.min(...steps), hi = Math.max(...steps), pad = (hi - lo) * 0.05 || lo * 0.05 || 1e-6;
  const ly = (s) => y1 - (y1 - y0) * (s - (lo - pad)) / ((hi + pad) - (lo - pad));
  el("polyline", { points: sizes.map((mb, k) => lx(mb) + "," + ly(steps[k])).join(" "), class: "curve" }, svg);
  el("line", { x1: lx(25), x2: lx(25), y1: y0, y2: y1, class: "default" }, svg);
  el("text", { x: lx(25) + 3, y: y0 + 10, class: "axis" }, svg).textContent = "25 MB default";
  el("circle", { cx: lx(sizes[bestK]), cy: ly(steps[bestK]), r: 6, class: "best" }, svg);
  const cur = Math.min(Math.max(state.bucket_mb, sizes[0]), sizes[sizes.length - 1]);
  el("line", { x1: lx(cur), x2: lx(cur), y1: y0, y2: y1, class: "current" }, svg);
  [1, 10, 100, 1000].forEach((mb) => { el("text", { x: lx(mb), y: H - 10, "text-anchor": "middle", class: "axis" }, svg).textContent = mb + " MB"; });
  el("text", { x: 4, y: ly(lo), class: "axis" }, svg).textContent = fmtTime(lo);
  el("text", { x: 4, y: ly(hi) + 10, class: "axis" }, svg).textContent = fmtTime(hi);
}

function update() {
  const prof = currentProfile();
  const r = simulateStep(prof, state.bucket_mb, init.first_bucket_mb, init.accum_steps);
  setKpi("kpi-step", fmtTime(r.step_s), r.step_s);
  setKpi("kpi-bwd", fmtTime(r.backward_s), r.backward_s);
  setKpi("kpi-comm", fmtTime(r.comm_s), r.comm_s);
  setKpi("kpi-exposed", fmtTime(r.exposed_s), r.exposed_s);
  setKpi("kpi-eff", (100 * r.efficiency).toFixed(1) + "%", r.efficiency);
  setKpi("kpi-buckets", String(r.buckets.length), r.buckets.length);
  $("v-bucket").textContent = fmtMb(state.bucket_mb) + " MB";
  $("v-bw").textContent = (state.bandwidth / 1e9).toPrecision(3) + " GB/s";
  $("v-alpha").textContent = fmtTime(state.alpha_s);
  $("v-layers").textContent = String(state.layers);
  drawTimeline(r);
  const sizes = DATA.sweep_sizes_mb, steps = sizes.map((mb) => simulateStep(prof, mb, init.first_bucket_mb, init.accum_steps).step_s);
  let best = 0;
  steps.forEach((s, k) => { if (s < steps[best]) best = k; });
  const def = simulateStep(prof, 25, init.first_bucket_mb, init.accum_steps).step_s;
  setKpi("kpi-opt", fmtMb(sizes[best]) + " MB", sizes[best]);
  setKpi("kpi-opt-step", fmtTime(steps[best]), steps[best]);
  setKpi("kpi-def-step", fmtTime(def), def);
  setKpi("kpi-gap", "+" + (100 * (def / steps[best] - 1)).toFixed(1) + "%");
  drawSweep(sizes, steps, best);
  const atInit = state.bucket_mb === init.bucket_mb && state.bandwidth === init.bandwidth &&
                 state.alpha_s === init.alpha_s && state.layers === init.layers;
  const agree = $("agree");
  if (atInit) {
    const rel = Math.abs(r.step_s - DATA.python.step_s) / DATA.python.step_s;
    agree.textContent = rel < 1e-9 ? "JavaScript and Python agree on the step time (" + fmtTime(r.step_s) + ")"
                                   : "MISMATCH with Python: " + fmtTime(DATA.python.step_s);
    agree.dataset.agree = String(rel < 1e-9);
  } else {
    agree.textContent = "Python computed " + fmtTime(DATA.python.step_s) + " at the initial settings";
    agree.dataset.agree = "n/a";
  }
}

function bind(id, toState) {
  $(id).addEventListener("input", (ev) => { toState(parseFloat(ev.target.value)); update(); });
}
$("s-bucket").value = Math.log2(init.bucket_mb);
$("s-bw").value = Math.log10(init.bandwidth / 1e9);
$("s-alpha").value = Math.log10(Math.max(init.alpha_s, 1e-6) * 1e6);
$("s-layers").value = init.layers;
bind("s-bucket", (v) => { state.bucket_mb = Math.pow(2, v); });
bind("s-bw", (v) => { state.bandwidth = Math.pow(10, v) * 1e9; });
bind("s-alpha", (v) => { state.alpha_s = Math.pow(10, v) * 1e-6; });
if (DATA.synthetic) bind("s-layers", (v) => { state.layers = Math.round(v); });
else { $("s-layers").disabled = true; $("layers-note").textContent = "(fixed by the profile)"; }
update();
