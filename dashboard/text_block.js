// A panel's heading and captions as plain text: every text is set as text, never as HTML or markdown.
// Payload: dashboard/text_block.py (bytes). el, sigOf, unpack: component_base.js.

export default function (component) {
  const { parentElement } = component;
  const sig = sigOf(component.data);
  if (parentElement.tbSig === sig) return; // the same text: leave it drawn
  const data = unpack(component.data);
  let box = parentElement.querySelector(".tb-block");
  if (!box) { box = el("div", "tb-block"); parentElement.appendChild(box); }
  const parts = [];
  if (data.heading) parts.push(el(`h${data.level}`, `tb-h${data.level}`, data.heading));
  for (const line of data.lines || []) parts.push(el("div", "tb-caption", line));
  box.replaceChildren(...parts);
  box.setAttribute("data-drawn", "");
  parentElement.tbSig = sig;
}
