// The monitor's time charts (load, job status, queued time, the runs Gantt): one canvas each, drawn
// from the columnar payload of dashboard/chart_data.py. Every label is set as text, never as HTML.
// A brush (drag across a Gantt) is sent back as state "brush" = [from_ms, to_ms]; a click clears it.

const MONTHS = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"];
const STEPS = [60e3, 300e3, 600e3, 900e3, 1800e3, 3600e3, 3 * 3600e3, 6 * 3600e3, 12 * 3600e3,
  86400e3, 2 * 86400e3, 7 * 86400e3, 28 * 86400e3];

const pad2 = (n) => String(n).padStart(2, "0");

// A chart's payload arrives as bytes (dashboard/chart_data.py, packed): JSON whose first key
// is sig, a digest of the rest. sigOf reads it from the first bytes; unpack parses the whole, which a
// component does only for a payload it has not drawn.
const utf8 = new TextDecoder();
function sigOf(bytes) {
  const m = /^\{"sig":"([0-9a-f]+)"/.exec(utf8.decode(bytes.subarray(0, 64)));
  return m ? m[1] : null;
}
function unpack(bytes) {
  return JSON.parse(utf8.decode(bytes));
}

// an element with a class and its text set as text (never as HTML)
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

// epoch ms as "YYYY-MM-DD HH:MM:SS" in UTC
function fmtTime(ms) {
  const t = new Date(ms);
  return `${t.getUTCFullYear()}-${pad2(t.getUTCMonth() + 1)}-${pad2(t.getUTCDate())} ` +
    `${pad2(t.getUTCHours())}:${pad2(t.getUTCMinutes())}:${pad2(t.getUTCSeconds())}`;
}


// The page's theme (light, dark or custom), from the --st-* variables Streamlit sets on components
// (each with Streamlit's light default where a variable is unset): text, grid, axis, font and, for a
// chart whose series have no meaning of their own (p.themed: groupings, load), the categorical palette.
function themeOf(host) {
  const cs = getComputedStyle(host);
  const v = (name, dflt) => { const x = (cs.getPropertyValue(name) || "").trim(); return x && x !== "unset" ? x : dflt; };
  const cat = v("--st-chart-categorical-colors", "").split(",").map((c) => c.trim()).filter(Boolean);
  return {
    INK: v("--st-text-color", "#31333f"), GRID: v("--st-border-color-light", "#e6e9ef"),
    MUTED: v("--st-gray-text-color", "#808495"), AXIS: v("--st-border-color", "#c3c6cf"),
    FONT: "12px " + v("--st-font", '"Source Sans", "Source Sans Pro", sans-serif'), cat,
  };
}

function fmt(v, f) {
  if (v === null || v === undefined || (typeof v === "number" && Number.isNaN(v))) return "n/a";
  if (f === "time") return fmtTime(v) + " UTC";
  if (typeof f === "number") return Number(v).toLocaleString("en-US", { minimumFractionDigits: f, maximumFractionDigits: f });
  return String(v);
}

function timeTicks(lo, hi, px) {
  const want = Math.max(2, Math.floor(px / 75));
  let step = STEPS[STEPS.length - 1];
  for (const s of STEPS) if ((hi - lo) / s <= want) { step = s; break; }
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) out.push(t);
  return { ticks: out, step };
}

function timeLabel(t, step) {
  const d = new Date(t);
  const day = `${MONTHS[d.getUTCMonth()]} ${d.getUTCDate()}`;
  if (step >= 86400e3) return day;
  const hm = `${pad2(d.getUTCHours())}:${pad2(d.getUTCMinutes())}`;
  return d.getUTCHours() === 0 && d.getUTCMinutes() === 0 ? day : hm;
}

function niceMax(max, n) {
  if (!(max > 0)) return { top: 1, step: 0.25 };
  const raw = max / n, mag = Math.pow(10, Math.floor(Math.log10(raw))), r = raw / mag;
  const step = (r <= 1 ? 1 : r <= 2 ? 2 : r <= 2.5 ? 2.5 : r <= 5 ? 5 : 10) * mag;
  return { top: Math.ceil(max / step - 1e-9) * step, step };
}

function numLabel(v) {
  const a = Math.abs(v);
  if (a >= 1e6) return (v / 1e6).toLocaleString("en-US", { maximumFractionDigits: 1 }) + "M";
  if (a >= 1e4) return (v / 1e3).toLocaleString("en-US", { maximumFractionDigits: 1 }) + "k";
  if (a > 0 && a < 0.01) return v.toLocaleString("en-US", { maximumSignificantDigits: 2 }); // not "0" at every tick
  return v.toLocaleString("en-US", { maximumFractionDigits: 2 });
}

function clip(ctx, s, w) {
  if (ctx.measureText(s).width <= w) return s;
  let lo = 0, hi = s.length;
  while (lo < hi) { const m = (lo + hi + 1) >> 1; if (ctx.measureText(s.slice(0, m) + "…").width <= w) lo = m; else hi = m - 1; }
  return s.slice(0, lo) + "…";
}

function parts(host) {
  // the chart's elements, made once per host: a redraw (new data, a resize) repaints them, so a drag
  // under way keeps its canvas and pointer capture
  if (host.ltParts) return host.ltParts;
  host.replaceChildren();
  host.className = "lt-chart";
  const legend = el("div", "lt-legend");
  const box = el("div", "lt-box");
  const cv = el("canvas", "lt-canvas");
  cv.setAttribute("role", "img");
  const brushEl = el("div", "lt-brush");
  const tip = el("div", "lt-tip");
  const note = el("div", "lt-note");
  box.append(cv, brushEl, tip);
  host.append(legend, box, note);
  host.ltParts = { legend, cv, brushEl, tip, note };
  return host.ltParts;
}

function draw(host, p, setStateValue) {
  const { legend, cv, brushEl, tip, note } = parts(host);
  const { INK, GRID, MUTED, AXIS, FONT, cat } = themeOf(host);
  const colors = p.themed && cat.length ? p.names.map((_, i) => cat[i % cat.length]) : p.colors;
  host.dataset.kind = p.kind;
  legend.replaceChildren();
  if (p.legend && p.names.length > 1) {
    if (p.legend_title) legend.appendChild(el("span", "lt-legend-title", p.legend_title));
    p.names.slice(0, 24).forEach((n, i) => {
      const it = el("span", "lt-legend-item");
      const sw = el("span", "lt-swatch"); sw.style.background = colors[i];
      it.append(sw, el("span", "", n));
      legend.appendChild(it);
    });
    if (p.names.length > 24) legend.appendChild(el("span", "lt-legend-item", `… ${p.names.length - 24} more`));
  }
  note.textContent = p.note || "";
  cv.setAttribute("aria-label", p.title);

  const W = Math.max(host.clientWidth || 600, 200), H = p.height;
  const dpr = window.devicePixelRatio || 1;
  cv.width = Math.round(W * dpr); cv.height = Math.round(H * dpr);
  cv.style.width = W + "px"; cv.style.height = H + "px";
  const ctx = cv.getContext("2d");
  ctx.scale(dpr, dpr);
  ctx.font = FONT;

  const it = p.items, n = (it.x || []).length, lanes = p.kind === "lanes";
  // the left margin: lane labels (clipped) or the value axis' labels
  let ymax = 0;
  if (!lanes) {
    for (let i = 0; i < n; i++) if (it.y1[i] > ymax) ymax = it.y1[i];
    for (const r of p.rules || []) if (r.y > ymax) ymax = r.y;
  }
  const ny = niceMax(ymax * 1.02, H > 200 ? 5 : 3);
  let left = 48;
  if (lanes) left = Math.min(200, Math.max(60, ...p.rows.slice(0, 400).map((s) => ctx.measureText(s).width + 14)));
  else left = Math.max(40, ctx.measureText(numLabel(ny.top)).width + 22);
  if (p.y_title) left += 16;
  const top = 8, bottom = p.x_title ? 38 : 24, right = 12;
  const pw = W - left - right, ph = H - top - bottom;
  const X = (t) => left + (t - p.x0) / ((p.x1 - p.x0) || 1) * pw;
  const T = (px) => p.x0 + (px - left) / pw * (p.x1 - p.x0);
  const Y = (v) => top + ph - v / ny.top * ph;
  const rows = p.rows.length || 1, rowH = ph / rows;

  // grid and axes
  ctx.fillStyle = MUTED; ctx.strokeStyle = GRID; ctx.lineWidth = 1;
  const tt = timeTicks(p.x0, p.x1, pw);
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (const t of tt.ticks) {
    const x = Math.round(X(t)) + 0.5;
    ctx.beginPath(); ctx.moveTo(x, top); ctx.lineTo(x, top + ph); ctx.stroke();
    ctx.fillText(timeLabel(t, tt.step), x, top + ph + 5);
  }
  if (p.x_title) ctx.fillText(p.x_title + " (UTC)", left + pw / 2, top + ph + 21);
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  if (lanes) {
    const every = Math.max(1, Math.ceil(12 / rowH));
    for (let r = 0; r < p.rows.length; r += every) ctx.fillText(clip(ctx, p.rows[r], left - 24), left - 6, top + (r + 0.5) * rowH);
  } else {
    for (let v = 0; v <= ny.top + 1e-9; v += ny.step) {
      const y = Math.round(Y(v)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + pw, y); ctx.stroke();
      ctx.fillText(numLabel(v), left - 6, y);
    }
  }
  if (p.y_title) {
    ctx.save(); ctx.translate(10, top + ph / 2); ctx.rotate(-Math.PI / 2);
    ctx.textAlign = "center"; ctx.fillText(p.y_title, 0, 0); ctx.restore();
  }

  // marks
  ctx.save();
  ctx.beginPath(); ctx.rect(left, top, pw, ph); ctx.clip();
  if (p.kind === "steps") {
    ctx.lineWidth = 2;
    for (let c = 0; c < p.names.length; c++) {
      ctx.strokeStyle = colors[c]; ctx.beginPath();
      let open = false;
      for (let i = 0; i < n; i++) {
        if (it.c[i] !== c || it.y1[i] === null) { continue; }
        const a = X(it.x[i]), b = X(it.x2[i]), y = Y(it.y1[i]);
        if (open) ctx.lineTo(a, y); else { ctx.moveTo(a, y); open = true; }
        ctx.lineTo(b, y);
      }
      ctx.stroke();
    }
    for (const r of p.rules || []) {
      ctx.strokeStyle = r.color; ctx.setLineDash([4, 3]); ctx.lineWidth = 1.5;
      const y = Math.round(Y(r.y)) + 0.5;
      ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(left + pw, y); ctx.stroke(); ctx.setLineDash([]);
    }
  } else {
    // one path per colour, filled once: marks of a chart never overlap (lanes' segments are merged below
    // a pixel, bars stack), so the order of colours does not show, and thousands of fillRect calls, each
    // after a fillStyle set, cost the lanes of a 100k-run week tens of ms per visit
    const paths = new Map();
    for (let i = 0; i < n; i++) {
      const a = X(it.x[i]), b = Math.max(X(it.x2[i]), a + 1);
      let path = paths.get(it.c[i]);
      if (!path) { path = new Path2D(); paths.set(it.c[i], path); }
      if (lanes) path.rect(a, top + it.row[i] * rowH + rowH * 0.1, b - a, Math.max(rowH * 0.8, 1));
      else {
        const y1 = Y(it.y1[i]), y0 = Y(it.y0[i]);
        path.rect(a, y1, Math.max(b - a - (b - a > 3 ? 1 : 0), 1), Math.max(y0 - y1, 1));
      }
    }
    for (const [c, path] of paths) { ctx.fillStyle = colors[c] || INK; ctx.fill(path); }
  }
  ctx.restore();
  ctx.strokeStyle = AXIS; ctx.beginPath(); ctx.moveTo(left, top + ph + 0.5); ctx.lineTo(left + pw, top + ph + 0.5); ctx.stroke();

  // hover: the mark under the pointer, its tooltip lines as text
  const hit = (mx, my) => {
    if (mx < left || mx > left + pw || my < top || my > top + ph) return -1;
    const t = T(mx);
    if (lanes) {
      const r = Math.floor((my - top) / rowH);
      let best = -1, bd = Infinity;
      for (let i = 0; i < n; i++) {
        if (it.row[i] !== r) continue;
        const a = X(it.x[i]), b = Math.max(X(it.x2[i]), a + 1);
        const d = mx < a ? a - mx : mx > b ? mx - b : 0;
        if (d < bd) { bd = d; best = i; }
      }
      return bd <= 3 ? best : -1;
    }
    const v = (top + ph - my) / ph * ny.top;
    let best = -1, bd = Infinity;
    for (let i = 0; i < n; i++) {
      if (!(it.x[i] <= t && t < it.x2[i])) continue;
      if (p.kind === "bars") { if (it.y0[i] <= v && v <= it.y1[i]) return i; continue; }
      const d = Math.abs(Y(it.y1[i]) - my);
      if (d < bd) { bd = d; best = i; }
    }
    return bd <= 12 ? best : -1;
  };
  const tipValue = (tp, i) => {
    if (tp.src === "name") return p.names[it.c[i]];
    if (tp.src === "row") return p.rows[it.row[i]];
    if (tp.src) return it[tp.src][i];
    return tp.values ? tp.values[i] : undefined;
  };
  const showTip = (i, mx, my) => {
    if (i < 0) { tip.style.display = "none"; return; }
    const lines = [];
    for (const tp of p.tips) {
      const row = el("div", "lt-tip-row");
      row.append(el("span", "lt-tip-label", tp.label + ": "), el("span", "lt-tip-value", fmt(tipValue(tp, i), tp.fmt)));
      lines.push(row);
    }
    tip.replaceChildren(...lines);
    tip.style.display = "block";
    const tw = tip.offsetWidth, th = tip.offsetHeight;
    tip.style.left = Math.max(0, Math.min(mx + 14, W - tw - 2)) + "px";
    tip.style.top = Math.max(0, my + 14 + th > H ? my - th - 10 : my + 14) + "px";
  };

  // brush: drag across time (lanes); shown from the state kept across reruns
  const showBrush = (a, b) => {
    if (a === null) { brushEl.style.display = "none"; return; }
    const l = Math.max(left, Math.min(a, b)), r = Math.min(left + pw, Math.max(a, b));
    Object.assign(brushEl.style, { display: "block", left: l + "px", width: Math.max(r - l, 1) + "px", top: top + "px", height: ph + "px" });
  };
  if (host.ltDrag === undefined) host.ltDrag = null;  // where a drag began (px), kept across redraws
  if (host.ltDrag === null) showBrush(p.brush && p.selected ? X(p.selected[0]) : null, p.selected ? X(p.selected[1]) : 0);
  const pos = (e) => { const r = cv.getBoundingClientRect(); return [e.clientX - r.left, e.clientY - r.top]; };
  cv.onpointerdown = (e) => {
    if (!p.brush) return;
    host.ltDrag = Math.max(left, Math.min(left + pw, pos(e)[0]));  // from the margins: a click there clears too
    tip.style.display = "none";
    cv.setPointerCapture(e.pointerId);
  };
  cv.onpointermove = (e) => {
    const [mx, my] = pos(e);
    if (host.ltDrag !== null) { showBrush(host.ltDrag, mx); return; }
    showTip(hit(mx, my), mx, my);
  };
  cv.onpointerleave = () => { if (host.ltDrag === null) tip.style.display = "none"; };
  cv.onpointerup = (e) => {
    if (host.ltDrag === null) return;
    const [mx] = pos(e), drag = host.ltDrag;
    const a = Math.max(left, Math.min(drag, mx)), b = Math.min(left + pw, Math.max(drag, mx));
    host.ltDrag = null;
    if (b - a < 3) {  // a click: clears the brush (if there is one: no rerun for nothing)
      if (brushEl.style.display === "block") { showBrush(null); setStateValue("brush", null); }
      return;
    }
    showBrush(a, b);
    setStateValue("brush", [Math.round(T(a)), Math.round(T(b))]);
  };
  host.dataset.drawn = String(n);
}

export default function (component) {
  const { parentElement, setStateValue } = component;
  let host = parentElement.querySelector(".lt-chart, .lt-host");
  if (!host) { host = el("div", "lt-host"); parentElement.appendChild(host); }
  // a rerun that sends the same chart keeps the drawn one (and a drag under way on it); sig: the
  // payload's digest, made on the server (chart_data.Payload.packed)
  const sig = sigOf(component.data);
  if (sig && host.ltSig === sig && host.ltRender) return host.ltCleanup;
  if (host.ltCleanup) host.ltCleanup();
  host.ltSig = sig;
  const data = unpack(component.data);
  const render = () => draw(host, data, setStateValue);
  render();
  let width = host.clientWidth;
  const ro = new ResizeObserver(() => {
    if (host.clientWidth !== width) { width = host.clientWidth; render(); }
  });
  ro.observe(host);
  host.ltRender = render;
  host.ltCleanup = () => { ro.disconnect(); host.ltRender = null; host.ltSig = null; };
  return host.ltCleanup;
}
