"""The live dashboard page a daemon serves at ``GET /`` (trainer and serving alike).

One self-contained HTML document: inline CSS and JavaScript, charts drawn as plain SVG, no
request to anywhere but the daemon itself (production hosts often have no internet). The
page holds no figures: it asks the daemon's ``/status`` and ``/history``
(``odl.http.metric_history``) every ``interval_s`` seconds and draws what they answer. With a
token configured those two endpoints answer 401 without it: the page then shows a token
field and nothing else, keeps the token in the tab's ``sessionStorage`` once entered, and
sends it as ``Authorization: Bearer`` from then on. ``GET /`` itself is open (the page's code
alone, the same for every daemon of a kind).

What is drawn is the daemon's :class:`DashboardLayout`: header fields (paths into the status
document, e.g. ``state``, ``publisher.last_version``) and charts, each a list of history
series; a series name ending in ``*`` takes every series with that prefix (``lag.*``: one
line per partition). A range selector shows the last 15 minutes, hour or day.

For tests and scripts, every chart's ``<svg>`` carries ``data-chart="<title>"`` and
``data-points`` (points drawn, all lines together); the status line carries
``id="updated"`` with the time of the last successful update.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Chart:
    """One chart of the page.

    Attributes:
        title: shown above it (also ``data-chart``).
        series: history series names; ``prefix*`` takes all with that prefix.
        unit: shown beside the title.
    """

    title: str
    series: tuple[str, ...]
    unit: str = ""


@dataclass(frozen=True)
class DashboardLayout:
    """What a daemon's page shows.

    Attributes:
        title: page title.
        header: ``(label, dotted path into the status document)`` pairs.
        charts: the charts, in order.
        alert_paths: dotted paths whose value, when set, is shown as a red banner (a
            failure, a checkpoint error).
    """

    title: str
    header: tuple[tuple[str, str], ...]
    charts: tuple[Chart, ...]
    alert_paths: tuple[str, ...] = field(default_factory=tuple)


_STYLE = """
body{font-family:system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:20px;margin:0 0 8px}
#head{display:flex;flex-wrap:wrap;gap:8px 24px;margin:8px 0;font-size:14px}
#head b{font-weight:600}
#alerts div{background:#fde8e8;color:#8a1c1c;padding:6px 10px;margin:4px 0;border-radius:4px}
#grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:12px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px}
.card h2{font-size:14px;margin:0 0 4px}
.legend{font-size:12px;color:#555}
.legend span{margin-right:10px}
#login{display:none;margin:24px 0}
#bar{font-size:12px;color:#666}
svg text{font-size:10px;fill:#666}
"""

_SCRIPT = r"""
const cfg = JSON.parse(document.getElementById('layout').textContent);
const colors = ['#1f77b4','#d62728','#2ca02c','#ff7f0e','#9467bd','#8c564b','#e377c2',
                '#7f7f7f','#bcbd22','#17becf'];
let hist = {t: [], series: {}};
let lastT = null;
function token() { return sessionStorage.getItem('odl_token') || ''; }
async function get(path) {
  const h = token() ? {'Authorization': 'Bearer ' + token()} : {};
  const r = await fetch(path, {headers: h, cache: 'no-store'});
  if (r.status === 401) { throw 'auth'; }
  if (!r.ok) { throw 'http ' + r.status; }
  return r.json();
}
function pick(doc, path) {
  let v = doc;
  for (const k of path.split('.')) { if (v === null || v === undefined) return null; v = v[k]; }
  return v === undefined ? null : v;
}
function esc(s) {
  return String(s).replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/"/g, '&quot;');
}
function fmt(v) {
  if (v === null || v === undefined) return '–';
  if (typeof v === 'number') {
    if (Math.abs(v) >= 1e4 || Number.isInteger(v)) return String(Math.round(v));
    return v.toPrecision(4);
  }
  return esc(v);
}
function merge(doc) {
  const n0 = hist.t.length;
  for (const name of Object.keys(doc.series)) {
    if (!(name in hist.series)) hist.series[name] = new Array(n0).fill(null);
  }
  hist.t = hist.t.concat(doc.t);
  for (const name of Object.keys(hist.series)) {
    const add = doc.series[name] || new Array(doc.t.length).fill(null);
    hist.series[name] = hist.series[name].concat(add);
  }
  if (doc.t.length) lastT = doc.t[doc.t.length - 1];
  // keep what the daemon keeps (a day): an open tab must not grow without bound
  let cut = 0;
  while (cut < hist.t.length && hist.t[cut] < lastT - 86400) cut++;
  if (cut) {
    hist.t = hist.t.slice(cut);
    for (const name of Object.keys(hist.series)) hist.series[name] = hist.series[name].slice(cut);
  }
}
function names(spec) {
  const out = [];
  for (const s of spec) {
    if (s.endsWith('*')) {
      const p = s.slice(0, -1);
      for (const n of Object.keys(hist.series).sort()) if (n.startsWith(p)) out.push(n);
    } else if (s in hist.series) out.push(s);
  }
  return out;
}
function draw(chart, el) {
  const W = 460, H = 170, L = 48, R = 8, T = 8, B = 20;
  const now = hist.t.length ? hist.t[hist.t.length - 1] : Date.now() / 1000;
  // the range chosen, or the history's own age when it is younger
  const first = hist.t.length ? hist.t[0] : now;
  const span = Math.max(Math.min(Number(document.getElementById('range').value), now - first),
                        1);
  const t0 = now - span;
  const lines = names(chart.series);
  el.style.display = lines.length ? '' : 'none';  // e.g. no dynamic tables in this model
  let lo = Infinity, hi = -Infinity, drawn = 0;
  for (const n of lines) hist.series[n].forEach((v, i) => {
    if (v !== null && hist.t[i] >= t0) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  });
  if (lo === Infinity) { lo = 0; hi = 1; }
  if (hi === lo && lo === 0) { hi = 1; }
  else if (hi === lo) { const d = Math.abs(lo) * 0.01; hi = lo + d; lo = lo - d; }
  const x = t => L + (W - L - R) * (t - t0) / span;
  const y = v => T + (H - T - B) * (1 - (v - lo) / (hi - lo));
  let svg = `<line x1="${L}" y1="${H-B}" x2="${W-R}" y2="${H-B}" stroke="#ccc"/>`;
  svg += `<text x="2" y="${T+8}">${fmt(hi)}</text><text x="2" y="${H-B}">${fmt(lo)}</text>`;
  const ago = span >= 120 ? Math.round(span / 60) + ' min' : Math.round(span) + ' s';
  svg += `<text x="${L}" y="${H-4}">-${ago}</text>`;
  svg += `<text x="${W-R-24}" y="${H-4}">now</text>`;
  let legend = '';
  lines.forEach((n, k) => {
    const c = colors[k % colors.length];
    const pts = [];
    hist.series[n].forEach((v, i) => {
      if (v !== null && hist.t[i] >= t0) pts.push(x(hist.t[i]).toFixed(1) + ',' + y(v).toFixed(1));
    });
    drawn += pts.length;
    if (pts.length > 1) svg += `<polyline fill="none" stroke="${c}" stroke-width="1.5" ` +
                               `data-series="${esc(n)}" points="${pts.join(' ')}"/>`;
    else if (pts.length) {  // one point so far: a dot
      const [cx, cy] = pts[0].split(',');
      svg += `<circle cx="${cx}" cy="${cy}" r="2.5" fill="${c}" data-series="${esc(n)}"/>`;
    }
    const known = hist.series[n].filter(v => v !== null);
    legend += `<span style="color:${c}">${esc(n)}: ${fmt(known[known.length - 1])}</span>`;
  });
  el.querySelector('svg').innerHTML = svg;
  el.querySelector('svg').setAttribute('data-points', String(drawn));
  el.querySelector('.legend').innerHTML = legend || '<span>no data yet</span>';
}
function render(status) {
  const head = cfg.header.map(([label, path]) =>
    `<span>${esc(label)}: <b>${fmt(pick(status, path))}</b></span>`).join('');
  document.getElementById('head').innerHTML = head;
  document.getElementById('alerts').innerHTML = cfg.alert_paths
    .map(p => [p, pick(status, p)]).filter(([, v]) => v)
    .map(([p, v]) => `<div>${esc(p)}: ${esc(v)}</div>`).join('');
  cfg.charts.forEach((c, i) => draw(c, document.getElementById('c' + i)));
}
async function tick() {
  try {
    const status = await get('status');
    merge(await get('history' + (lastT === null ? '' : '?since=' + lastT)));
    document.getElementById('login').style.display = 'none';
    document.getElementById('main').style.display = '';
    render(status);
    document.getElementById('updated').textContent = new Date().toLocaleTimeString();
  } catch (e) {
    if (e === 'auth') {
      document.getElementById('main').style.display = 'none';
      document.getElementById('login').style.display = 'block';
    } else {
      document.getElementById('bar').dataset.error = String(e);
    }
  }
}
document.getElementById('login').addEventListener('submit', ev => {
  ev.preventDefault();
  sessionStorage.setItem('odl_token', document.getElementById('token').value.trim());
  hist = {t: [], series: {}}; lastT = null; tick();
});
document.getElementById('range').addEventListener('change', () => tick());
const grid = document.getElementById('grid');
cfg.charts.forEach((c, i) => {
  const d = document.createElement('div');
  d.className = 'card'; d.id = 'c' + i;
  d.innerHTML = `<h2></h2><svg viewBox="0 0 460 170" width="100%" data-points="0"></svg>` +
                `<div class="legend"></div>`;
  d.querySelector('h2').textContent = c.title + (c.unit ? ' (' + c.unit + ')' : '');
  d.querySelector('svg').setAttribute('data-chart', c.title);
  grid.appendChild(d);
});
tick();
setInterval(tick, Math.max(1000, cfg.interval_s * 1000));
"""


def dashboard_html(layout: DashboardLayout, interval_s: float) -> str:
    """The page of ``layout`` (module docstring).

    Args:
        layout: what the page shows.
        interval_s: seconds between updates (the history's sampling interval).

    Returns:
        The HTML document.
    """
    doc = asdict(layout)
    doc["interval_s"] = float(interval_s)
    # JSON inside <script>: "<" escaped so no value can close the element
    data = json.dumps(doc).replace("<", "\\u003c")
    title = layout.title.replace("&", "&amp;").replace("<", "&lt;")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>{_STYLE}</style></head>
<body>
<h1>{title}</h1>
<form id="login"><p>This daemon requires a bearer token (--auth_token_file /
ODL_AUTH_TOKEN).</p><input id="token" type="password" size="40" autocomplete="off">
<button type="submit">Show</button></form>
<div id="main" style="display:none">
<div id="head"></div><div id="alerts"></div>
<div id="bar">range <select id="range"><option value="900">15 min</option>
<option value="3600" selected>1 hour</option><option value="86400">24 hours</option>
</select> · updated <span id="updated">never</span></div>
<div id="grid"></div></div>
<script type="application/json" id="layout">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
