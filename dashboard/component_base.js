// Helpers the component scripts of the monitor use (timeline.js, light_table.js, figures.js, ...): put in
// front of each by dashboard/component_js.py, since each script is its own module with no imports.

const pad2 = (n) => String(n).padStart(2, "0");

// A chart's or table's payload arrives as bytes (dashboard/component_js.py, packed): JSON whose first key
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

// A "?" that explains `text` on hover, by keyboard focus and to assistive technology (its look: HELP_CSS in
// dashboard/component_js.py)
function helpIcon(text) {
  const help = el("span", "pl-help", "?");
  help.title = text;
  help.tabIndex = 0;
  help.setAttribute("aria-label", text);
  return help;
}

// Draw a component's payload in its box (a div of class `cls`, made on the first mount, beside the style
// element Streamlit keeps in the same parent): `draw(box, payload)` runs only for a payload not drawn
// there already (its sig), so a rerun sending the same one leaves the drawing as it is; the box is then
// marked data-drawn.
function drawOnce(component, cls, draw) {
  const { parentElement } = component;
  const sig = sigOf(component.data);
  if (sig && parentElement.drawnSig === sig) return;
  let box = parentElement.querySelector(`:scope > .${cls}`);
  if (!box) { box = el("div", cls); parentElement.appendChild(box); }
  draw(box, unpack(component.data));
  box.setAttribute("data-drawn", "");
  parentElement.drawnSig = sig;
}

// epoch ms as "YYYY-MM-DD HH:MM:SS" in UTC
function fmtTime(ms) {
  const t = new Date(ms);
  return `${t.getUTCFullYear()}-${pad2(t.getUTCMonth() + 1)}-${pad2(t.getUTCDate())} ` +
    `${pad2(t.getUTCHours())}:${pad2(t.getUTCMinutes())}:${pad2(t.getUTCSeconds())}`;
}

