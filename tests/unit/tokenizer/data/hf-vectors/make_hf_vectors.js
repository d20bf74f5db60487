// Reference vectors from Hugging Face tokenizers itself (the Rust library through its Node
// bindings, npm package "tokenizers" 0.23.2): random text, encoded without special tokens added,
// decoded with and without skip_special_tokens. Run once; the JSON files are checked in and the
// tests never run this:
//   npm install tokenizers@0.23.2 (in a scratch directory), then
//   node make_hf_vectors.js TOKENIZER.json OUT.json N SEED [special-token texts...]
//   python3 filter_unicode14.py OUT.json     (drops text with characters new since Unicode 14)
// The text mixes words and contractions in both cases, white space of every kind (U+0085,
// U+180E, U+3000, ...), digits of several scripts, punctuation runs, CJK, emoji sequences,
// combining marks, random code points, and the given special-token texts.
const {Tokenizer}=require('tokenizers');
const fs=require('fs');
const [file,out,N,seed]=process.argv.slice(2); const specials=process.argv.slice(6);
const t=Tokenizer.fromFile(file);
let s=BigInt(seed)||1n; const M=(1n<<64n)-1n;
function rnd(n){ s^=s>>12n; s^=(s<<25n)&M; s^=s>>27n; return Number(((s*0x2545F4914F6CDD1Dn)&M)>>33n)%n; }
const pick=a=>a[rnd(a.length)];
const words=["the","Hello","world","don't","I'm","we'LL","WE'RE","it'S","x'ſ","'ll","'Ve","a","cpp","x_y","naïve","Führer","東京","ÅNGSTRÖM","hello.world","foo@bar.com","https://x.y/z?q=1"];
const ws=[" ","  ","   ","\t","\n","\n\n","\r\n","\r","\u00a0","\u0085","\u180e","\u2028","\u3000","\u000b","\u000c","\u200b","\ufeff"," \n "," \t\n"];
const digits=["0","12","123","1234","12345","3.14","1,000","٣٤٥","１２３","²","Ⅻ","½"];
const punct=[".",",","!","?","...","!!!","--","''''","``","«","»","“","”","(",")","#","@","$$","%","&&","<",">","|","<|",">|","'","\"","\\","/","::"];
function cp(c){return String.fromCodePoint(c);}
function unit(){
  switch(rnd(16)){
  case 0: case 1: { let w=pick(words); if(rnd(4)==0) w=w.toUpperCase(); return w; }
  case 2: case 3: return pick(ws);
  case 4: return pick(digits);
  case 5: return pick(punct);
  case 6: return cp(0x4E00+rnd(0x5200));
  case 7: return pick(["🦙","😀","👍🏽","👨‍👩‍👧","🇺🇸","❤️","✨"]);
  case 8: return cp(pick([0x430,0x627,0x915,0xAC00,0x3B1,0xE01,0x5D0])+rnd(20))+(rnd(3)==0?cp(pick([0x301,0x94D,0x308,0x651])):"");
  case 9: return cp(pick([0xE9,0xFC,0xF1,0xE7,0xC5,0xDF,0x153,0x131,0x17F,0x212A,0x130]));
  case 10: { let c=1+rnd(0x10FFFF); if(c>=0xD800&&c<0xE000) c-=0x800; return cp(c); }
  case 11: { let c=1+rnd(0x3000); if(c>=0xD800&&c<0xE000) c-=0x800; return cp(c); }
  case 12: return specials.length? pick(specials): "z";
  case 13: return String.fromCharCode(97+rnd(26)).repeat(1+rnd(12));
  case 14: return " "+pick(words);
  default: return pick(["'s","'S","'t","'re","'m","'d","'ll","'LL","'ſ"]);
  }
}
(async()=>{
  const cases=[];
  for(let i=0;i<Number(N);i++){
    let text=""; const u=rnd(40); for(let k=0;k<u;k++) text+=unit();
    const e=await t.encode(text,null,{addSpecialTokens:false});
    const ids=e.getIds();
    cases.push({text, ids, dec: await t.decode(ids,false), dec_skip: await t.decode(ids,true)});
  }
  fs.writeFileSync(out, JSON.stringify(cases));
})();
