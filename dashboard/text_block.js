// A panel's heading and captions as plain text: every text is set as text, never as HTML or markdown.
// Payload: dashboard/text_block.py (bytes). el, drawOnce: component_base.js.

export default function (component) {
  drawOnce(component, "tb-block", (box, data) => {
    const parts = [];
    if (data.heading) parts.push(el(`h${data.level}`, `tb-h${data.level}`, data.heading));
    for (const line of data.lines || []) parts.push(el("div", "tb-caption", line));
    box.replaceChildren(...parts);
  });
}
