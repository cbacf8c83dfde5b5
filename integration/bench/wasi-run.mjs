// Runs a wasm32-wasip1 program in Node's V8, the engine Envoy embeds, so a
// benchmark built for the filter's target measures what the filter's code
// costs there. Usage: node --no-warnings wasi-run.mjs PROGRAM.wasm [ARGS...]
import { readFile } from 'node:fs/promises';
import { argv, exit } from 'node:process';
import { WASI } from 'node:wasi';

const [program, ...args] = argv.slice(2);
if (!program) {
  console.error('usage: node --no-warnings wasi-run.mjs PROGRAM.wasm [ARGS...]');
  exit(2);
}
const wasi = new WASI({ version: 'preview1', args: [program, ...args], env: {}, preopens: {}, returnOnExit: true });
const module = await WebAssembly.compile(await readFile(program));
const instance = await WebAssembly.instantiate(module, wasi.getImportObject());
exit(wasi.start(instance));
